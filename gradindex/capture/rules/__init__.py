"""Built-in layer rules, one file per layer type; importing this package registers them."""

from gradindex.capture.rules import conv1d, experts, linear  # noqa: F401
