"""How the router listens and runs as a server process."""
