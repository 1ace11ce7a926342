"""tideline package."""
