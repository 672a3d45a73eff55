"""The object tier (``object_url``) in a real vLLM engine, against a real Ceph RGW (issue 44).

Node A (its own root, the bucket behind it) stores a prompt's pages; node B, a fresh engine on
an empty root of its own and the same bucket, finds them through the scheduler's index of the
bucket (one listing), loads them from the object tier and answers with the cold run's first
token top-5 logprobs. A damaged object is a miss there, never a wrong answer: the check fails
on bad KV: with every object rewritten with its values reversed (checksums recomputed, so the
pages are served), a third fresh node answers with other logprobs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm_helpers import failures, prompt_ids, rewrite_page, run_engine  # noqa: E402


def _tier(reported: dict, family: str, tier: str, *labels: str) -> float:
    return reported.get(f"tierstore_tier_{family}_total:{(tier, *labels)}", 0)


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory):
    """The prompt's cold run (no cache at all): the tokens and logprobs every restore must give."""
    return run_engine("llama", tmp_path_factory.mktemp("cold"), [{"prompt_token_ids": prompt_ids("llama")}],
                      logprobs=5)


def test_a_fresh_node_on_an_empty_root_restores_from_the_bucket(tmp_path: Path, s3_env, s3_bucket, cold) -> None:
    url = f"s3://{s3_bucket}/fleet"
    ids = prompt_ids("llama")
    req = [{"prompt_token_ids": ids}]
    first = run_engine("llama", tmp_path / "a", req, logprobs=5, extra={"object_url": url, "index_refresh_s": 0})
    assert first.outputs[0].cached == 0
    stored_pages = _tier(first.reported, "stores", "object")
    assert stored_pages > 0, first.reported

    second = run_engine("llama", tmp_path / "b", req, logprobs=5, extra={"object_url": url, "index_refresh_s": 0})
    r = second.reported
    hit_pages, hit_tokens = _tier(r, "loads", "object", "hit"), _tier(r, "load_tokens", "object", "hit")
    print(f"\nobject tier: pages stored by node A {stored_pages:.0f}; node B loaded {hit_pages:.0f} of them "
          f"({hit_tokens:.0f} tokens); node B's cached prompt tokens {second.outputs[0].cached} of {len(ids)}")
    assert not failures(second.worker), second.worker
    assert hit_pages >= 0.95 * stored_pages and hit_tokens > 0, r  # every page is the same size
    assert second.outputs[0].cached >= hit_tokens
    assert not list((tmp_path / "b").rglob("*.kvp")) or _tier(r, "loads", "root", "hit") == 0, r
    assert second.outputs[0].tokens == cold.outputs[0].tokens
    assert second.outputs[0].first_logprobs == cold.outputs[0].first_logprobs

    # The check can fail: the same pages with their values reversed, checksums valid, are served
    # by the bucket to a third fresh node, whose answer differs.
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"], region_name=s3_env["AWS_REGION"])

    def scramble(buf: bytearray) -> None:
        import torch

        t = torch.frombuffer(buf, dtype=torch.bfloat16)
        t.copy_(t.flip(0))

    work = tmp_path / "rewrite.kvp"
    names = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix="fleet/").get("Contents", [])
             if o["Key"].endswith(".kvp")]
    assert names
    for name in names:
        work.write_bytes(s3.get_object(Bucket=s3_bucket, Key=name)["Body"].read())
        rewrite_page(work, scramble)
        s3.put_object(Bucket=s3_bucket, Key=name, Body=work.read_bytes())
    third = run_engine("llama", tmp_path / "c", req, logprobs=5, extra={"object_url": url, "index_refresh_s": 0})
    assert _tier(third.reported, "loads", "object", "hit") > 0 and not failures(third.worker), third.reported
    assert third.outputs[0].first_logprobs != cold.outputs[0].first_logprobs


def test_a_connector_with_only_a_bucket_restores_a_fresh_engine(tmp_path: Path, s3_env, s3_bucket, cold) -> None:
    """``{"object_url": ...}`` and nothing else: the bucket is the one durable tier. A fresh
    engine hits at least 95% of the pages the first stored, with the cold run's logprobs."""
    url = f"s3://{s3_bucket}/only"
    ids = prompt_ids("llama")
    req = [{"prompt_token_ids": ids}]
    only = {"object_url": url, "index_refresh_s": 0}
    first = run_engine("llama", None, req, logprobs=5, extra=only)
    stored_pages = _tier(first.reported, "stores", "object")
    assert first.outputs[0].cached == 0 and stored_pages > 0, first.reported
    second = run_engine("llama", None, req, logprobs=5, extra=only)
    r = second.reported
    hit_pages = _tier(r, "loads", "object", "hit")
    print(f"\nonly object_url: pages stored {stored_pages:.0f}, a fresh engine loaded {hit_pages:.0f}; cached "
          f"{second.outputs[0].cached} of {len(ids)} prompt tokens")
    assert not failures(second.worker), second.worker
    assert hit_pages >= 0.95 * stored_pages, r
    assert second.outputs[0].tokens == cold.outputs[0].tokens
    assert second.outputs[0].first_logprobs == cold.outputs[0].first_logprobs
