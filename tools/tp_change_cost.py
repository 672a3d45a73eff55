"""What serving a page across a tensor-parallel change costs each rank: files opened, bytes
read (verified) and bytes scattered, for a model shape, from real page files.

    python tools/tp_change_cost.py [--kv-heads 8 --layers 32 --head-size 128 --tokens 128]
                                   [--mamba2 HEADS,HEAD_DIM,GROUPS,STATE] [--root DIR] [--json]

``--mamba2``: a Mamba2 group instead (``--layers`` layers of conv + ssm states, bf16; e.g.
``128,64,1,128``: Granite 4.0-H, B and C replicated on every rank; ``128,64,8,128``: Nemotron-H).

For each (writer TP, reader TP) pair of {1, 2, 4, 8} (GQA replication where TP > KV heads) it
writes the writer ranks' head-slice files of one page (tierstore.format.head_slices, the format
the engine writes), then has every reader rank assemble its heads (``cover`` + ``assemble``:
each file fully verified before a byte is copied) and prints per reader rank the files opened,
the bytes read, the bytes scattered and their ratio (the read amplification), and the seconds
(page cache warm: this is the CPU cost of verification and copying, not the disk's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierstore.format.head_slices import (  # noqa: E402
    HeadRange,
    copy_heads,
    cover,
    rank_heads,
    slice_layout,
    slice_units,
)
from tierstore.format.layout import mamba_layout  # noqa: E402
from tierstore.format.page import GroupKind, PageExpectation  # noqa: E402
from tierstore.testing.pages import (  # noqa: E402
    layout_namespace,
    page_bytes,
    page_key,
    simple_namespace,
    write_slice_page,
)
from tierstore.tiers.assembly import assemble  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--mamba2", default=None, metavar="HEADS,HEAD_DIM,GROUPS,STATE")
    ap.add_argument("--root", default=None, help="where to write the pages (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.mamba2:
        heads, head_dim, groups, state = (int(x) for x in args.mamba2.split(","))
        layers = [f"model.layers.{i}.mixer" for i in range(args.layers)]
        ns = layout_namespace(mamba_layout(layers, [("conv", (heads * head_dim + 2 * groups * state, 3), "bfloat16"),
                                                    ("ssm", (heads, head_dim, state), "bfloat16")]),
                              args.tokens, kind=GroupKind.MAMBA, layer_names=layers)
        what = f"Mamba2 {heads} heads x {head_dim}, {groups} group(s), state {state}, {args.layers} layers"
    else:
        ns = simple_namespace("bfloat16", num_kv_heads=args.kv_heads, num_layers=args.layers,
                              head_size=args.head_size, tokens_per_chunk=args.tokens)
        what = f"{args.kv_heads} KV heads, {args.layers} layers, head size {args.head_size}, {args.tokens} tokens"
    full_layout, key = ns.groups[0].layout, page_key(0)
    units = slice_units(full_layout)
    assert units is not None
    everything = HeadRange(0, units)
    full = memoryview(page_bytes(full_layout, key))
    rows = []
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        tps = [t for t in (1, 2, 4, 8)]
        for w_tp in tps:
            base = Path(tmp) / f"w{w_tp}"
            files: dict[HeadRange, tuple[Path, PageExpectation]] = {}
            for r in range(w_tp):
                heads = rank_heads(units, w_tp, r)
                if heads in files:
                    continue  # GQA replication: ranks holding the same head share one file
                data = bytearray(slice_layout(full_layout, heads).nbytes)
                copy_heads(full_layout, full, everything, memoryview(data), heads)
                files[heads] = write_slice_page(base, ns, bytes(data), heads, key)
            for r_tp in tps:
                need = rank_heads(units, r_tp, 0)  # every reader rank costs the same
                plan = cover(need, list(files))
                assert plan is not None
                out = memoryview(bytearray(slice_layout(full_layout, need).nbytes))
                t0 = time.perf_counter()
                cost = assemble(need, plan, full_layout, out, files.__getitem__)
                rows.append({"writer_tp": w_tp, "reader_tp": r_tp, "files": cost.files, "bytes_read": cost.bytes_read,
                             "bytes_scattered": cost.bytes_scattered, "amplification": round(cost.amplification, 3),
                             "seconds": round(time.perf_counter() - t0, 4)})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{what}: {full_layout.nbytes} bytes per full page (bf16); per reader rank:")
        print("writer TP  reader TP  files  bytes read  bytes scattered  read/scattered  seconds")
        for x in rows:
            print(f"{x['writer_tp']:>9}  {x['reader_tp']:>9}  {x['files']:>5}  {x['bytes_read']:>10}  "
                  f"{x['bytes_scattered']:>15}  {x['amplification']:>14}  {x['seconds']:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
