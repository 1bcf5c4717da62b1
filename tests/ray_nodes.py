"""Local Ray nodes for the tests that need a cluster of their own (``ray.cluster_utils``), each
start tried again when Ray gave up on it."""

from __future__ import annotations

NODE_START_TRIES = 3


def add_node(nodes, **args):
    """A node of the local cluster (the first: its head), its start tried again (up to
    ``NODE_START_TRIES`` in all) if Ray gave up on it: a raylet on a loaded 2-core machine can
    take longer than Ray's fixed 30 s to register (seen in full-suite runs: the head's first try
    failed in both of one day's runs, and with a second job beside the suite the retry too;
    test_fleet's four nodes take 20-30 s in all when it does not). A try that failed leaves its
    processes running (its GCS served nothing until the suite ended, 7 minutes later, loading
    the machine the retry needed): they are ended before the next try."""
    import psutil

    me = psutil.Process()
    for tries_left in range(NODE_START_TRIES - 1, -1, -1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            return nodes.add_node(**args)
        except Exception as e:
            if tries_left == 0 or ("timed out during startup" not in str(e)
                                   and "Timed out waiting for file" not in str(e)):
                raise
            left = [p for p in me.children(recursive=True) if p.pid not in before]
            for p in left:
                try:
                    p.kill()
                except psutil.NoSuchProcess:  # ended between the listing and the kill
                    pass
            psutil.wait_procs(left, timeout=10)
