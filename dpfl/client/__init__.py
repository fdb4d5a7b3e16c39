"""Flower client side: the NumPyClient and the ClientApp (the client side of the Flower transport)."""
