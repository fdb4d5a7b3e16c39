"""Client side: the shared client runtime, the NumPyClient and the ClientApp."""
