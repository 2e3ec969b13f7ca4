"""One adapter per library, each run as ``python -m benchmarks.peers.adapters.<name>`` in that library's venv."""
