"""gradindex and its peers side by side (``python -m benchmarks.peers.run``)."""
