"""The decoding method: MARS, AR, exact and hybrid modes, the batch schemes, acceptance, width and the figures."""
