"""Making steering vectors: ``steerserve tune`` and the ``lab`` steps it chains; ``reference``
is the engine's oracle. The server imports nothing from here.
"""
