"""Flower server side: the ServerApp."""
