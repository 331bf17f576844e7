"""API keys and their scopes: who is calling, and what the key allows."""
