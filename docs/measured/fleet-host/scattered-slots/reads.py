"""The KV cache's reads compared by the scripts beside this one: ``old`` as before the change
(advanced indexing for scattered slots, a view for a run of slots), ``gather`` (index_select for
scattered slots, a view for a run), ``view`` (a view for a run, whatever else) and ``copy`` (a
run of slots copied compact on the CPU: as landed)."""
from edgespec.runner import kv_cache

landed = kv_cache.KVCache.read


def _run(self, layer, slots, start, n_pos):
    end = start + slots.numel()
    return self.k[layer][start:end, :, :n_pos], self.v[layer][start:end, :, :n_pos]


def old(self, layer, slots, contiguous_from, n_pos):
    if contiguous_from is not None:
        return _run(self, layer, slots, contiguous_from, n_pos)
    return self.k[layer][slots, :, :n_pos], self.v[layer][slots, :, :n_pos]


def gather(self, layer, slots, contiguous_from, n_pos):
    if contiguous_from is not None:
        return _run(self, layer, slots, contiguous_from, n_pos)
    return landed(self, layer, slots, None, n_pos)


def copy(self, layer, slots, contiguous_from, n_pos):
    k, v = gather(self, layer, slots, contiguous_from, n_pos)
    return k.contiguous(), v.contiguous()


READS = {"old": old, "gather": gather, "view": gather, "copy": copy}


def use(name: str) -> None:
    kv_cache.KVCache.read = READS[name]
