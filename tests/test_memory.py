"""Memory flat in N (issue 21 item 9): a default build's peak RSS at 3,000 examples is that at 300."""

from __future__ import annotations

from benchmarks.build_memory import measure


def test_default_build_peak_rss_is_flat_from_300_to_3000_examples():
    """Each build in its own process (peak RSS is per process): the capture, the fused fit and the
    transcode stream the store in blocks, so ten times the examples add no block. (Before: 777 MB at
    300 and 1,432 MB at 3,000, the transcode reading 1,024 rows of every layer at a time and the heap
    keeping the holes of every freed block.)"""
    small, large = measure(300), measure(3000)
    print(small, large)
    assert large["peak_rss_mb"] <= 1.2 * small["peak_rss_mb"], (small, large)
