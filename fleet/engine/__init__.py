"""The engine on one device: models, profiles, importance, the exact DP, and the elastic trainer."""
