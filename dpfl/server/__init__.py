"""Server side: the shared server runtime and the ServerApp."""
