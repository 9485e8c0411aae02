"""The HTTP front end: OpenAI-compatible routes and admin over one engine, and the router process
in front of worker processes."""
