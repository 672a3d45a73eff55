"""Caller-thread cost and throughput of the tier chain against a plain IOEngine (the baseline,
measured in the same run). Prints JSON with absolute figures and ratios to the baseline.

    .venv/bin/python tools/bench_tiers.py [--pages 200] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from tierstore.config import TierStoreConfig
from tierstore.metrics import MetricsRegistry
from tierstore.rootstore.engine import IOEngine
from tierstore.testing.pages import page_bytes, page_key, simple_namespace
from tierstore.tiers import TierChain


def run(st, n: int) -> dict[str, float]:
    data = page_bytes(st.layout, page_key(0))
    submit = 0.0
    ids = []
    t0 = time.perf_counter()
    for i in range(n):
        slot = st.acquire_slot(10)
        slot.view[:] = data
        t = time.perf_counter()
        ids.append(st.submit_store(page_key(i), slot, 64))
        submit += time.perf_counter() - t
        st.poll()
    st.flush(120)
    st.wait(ids, 60)
    store_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        (r,) = st.wait([st.submit_load(page_key(i))], 30)
        assert r.ok, r.error
        st.release_slot(r.slot)
    return {"submit_store_us": submit / n * 1e6, "store_wall_s": store_wall, "load_wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=200)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    d = tempfile.mkdtemp(dir=a.dir)
    ns = simple_namespace(tokens_per_chunk=64, num_layers=8, num_kv_heads=4, head_size=64)  # 512 KiB pages
    cap = 2 * a.pages * ns.groups[0].layout.nbytes
    out = {}
    eng = IOEngine(d + "/plain", ns, 0, config=TierStoreConfig(root=d + "/plain"))
    out["engine"] = run(eng, a.pages)
    eng.close()
    for name, shared in (("chain_local", False), ("chain_local_shared", True)):
        cfg = TierStoreConfig.from_dict({"root": f"{d}/{name}-shared", "local_root": f"{d}/{name}-local",
                                         "local_max_bytes": cap})
        st = TierChain(cfg, ns, 0, metrics=MetricsRegistry(), shared=shared)
        out[name] = run(st, a.pages)
        st.close()
    base = out["engine"]
    ratios = {name: {k: round(v / base[k], 2) for k, v in r.items()} for name, r in out.items() if name != "engine"}
    print(json.dumps({"page_bytes": ns.groups[0].layout.nbytes, "pages": a.pages,
                      "absolute": {n: {k: round(v, 4) for k, v in r.items()} for n, r in out.items()},
                      "ratio_to_engine": ratios}, indent=1))


if __name__ == "__main__":
    main()
