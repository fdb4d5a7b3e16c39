"""Flower client side: the NumPyClient and the ClientApp (the Flower transport's client end)."""
