"""`specroute bench`: measure an OpenAI-compatible endpoint the way the field note did."""
