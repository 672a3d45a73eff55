"""One "node" of the two-node NFS test: stores and loads pages through a TierChain, verifies
every page it gets, and prints its counts as JSON on the last line.

    python nfs_node_worker.py --root MOUNT --local DIR --own A:B --all N --seconds S --seed K
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tiers_helpers import expected, key  # noqa: E402

from tierstore.config import TierStoreConfig  # noqa: E402
from tierstore.format.identity import page_file_size  # noqa: E402
from tierstore.metrics import MetricsRegistry  # noqa: E402
from tierstore.testing.pages import simple_namespace  # noqa: E402
from tierstore.tiers import TierChain  # noqa: E402


def namespace():
    # 128 KiB pages: big enough that a torn read would span several FUSE requests
    return simple_namespace("float16", tokens_per_chunk=64, num_layers=2, num_kv_heads=4, head_size=64)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--local", required=True)
    ap.add_argument("--local-pages", type=int, default=6)
    ap.add_argument("--own", required=True, help="A:B, the key indexes this node stores")
    ap.add_argument("--all", type=int, required=True, help="keys 0..N-1 are loaded")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    lo, hi = map(int, a.own.split(":"))
    own = list(range(lo, hi))
    reg = MetricsRegistry()
    file_size = page_file_size(namespace(), 0)
    cfg = TierStoreConfig.from_dict({"root": a.root, "local_root": a.local,
                                     "local_max_bytes": a.local_pages * file_size,
                                     "shared_deadline_s": 5.0, "shared_touch_interval_s": 0.5})
    st = TierChain(cfg, namespace(), 0, metrics=reg)
    rng = random.Random(a.seed)
    c = {"loads": 0, "hits": 0, "cross_node_hits": 0, "wrong": 0, "misses": 0, "load_failures": {},
         "stores": 0, "store_failures": {}}
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        if rng.random() < 0.35:
            i = rng.choice(own)
            slot = st.acquire_slot(5)
            slot.view[:] = expected(st, key(i))
            (r,) = st.wait([st.submit_store(key(i), slot, 64)], 30)
            c["stores"] += 1
            if not r.ok:
                c["store_failures"][r.error.kind] = c["store_failures"].get(r.error.kind, 0) + 1
            continue
        i = rng.randrange(a.all)
        res = st.wait([st.submit_load(key(i))], 30)
        c["loads"] += 1
        if not res:
            c["load_failures"]["no_result"] = c["load_failures"].get("no_result", 0) + 1
            continue
        r = res[0]
        if r.ok:
            good = bytes(r.slot.view) == expected(st, key(i))
            st.release_slot(r.slot)
            c["hits" if good else "wrong"] += 1
            if good and i not in own:
                c["cross_node_hits"] += 1
        elif r.error.kind == "missing":
            c["misses"] += 1
        else:
            c["load_failures"][r.error.kind] = c["load_failures"].get(r.error.kind, 0) + 1
    st.flush(30)
    st.close()
    c["tiers"] = {t: {k: v for k, v in m.items() if not k.endswith("_seconds")} for t, m in reg.snapshot().items()}
    print(json.dumps(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
