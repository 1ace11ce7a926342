"""Example applications built on Tideline (``examples.reservations``: theatre seats and users)."""
