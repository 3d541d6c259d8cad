"""A bucket reached through options alone: ``trainer.resume=s3://...`` and every command that reads a bucket.

Nothing here sets the AWS environment: the endpoint and credentials reach the store only as
``checkpoint.storage_options`` (training, and a resume from a checkpoint URL) or
``--storage-option KEY=VALUE`` (``verify``, ``inspect``, ``consolidate``, ``sign``,
``lineage``, ``report``); ``lineage`` and ``report`` of a run directory fall back on the options
its ``config.yaml`` recorded. Wrong options given explicitly win over the recorded ones and are
refused by the store, which shows they are the ones used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from shardline import cli
from shardline.checkpoint.provenance.ledger import Ledger
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.seaweed import S3Server
from tests.checkpoint.test_signing import _write_key
from tests.train.test_cli import GPT_SMALL, PYTHONPATH, ROOT, SMALL

pytestmark = pytest.mark.timeout(120)

COMMON = [*SMALL, *GPT_SMALL, "~callbacks.tensorboard", "~callbacks.loss_plot", "trainer.devices=1"]


def _env() -> dict[str, str]:
    """This process's environment without any AWS setting: the options below are the only way to the store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}


def _run(*args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shardline.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())


def test_resume_from_a_checkpoint_url_and_every_command_with_storage_options(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    options = s3_server.storage_options()
    in_config = [f"+checkpoint.storage_options.{k}={v}" for k, v in options.items()]
    flags = [f"--storage-option={k}={v}" for k, v in options.items()]
    url = f"s3://{S3_BUCKET}/opts-{uuid.uuid4().hex[:12]}"

    bucket_run = tmp_path / "bucket-run"
    first = _run("train", *COMMON, "trainer.max_steps=3", f"trainer.run_dir={bucket_run}", f"checkpoint.dir={url}",
                 *in_config)  # fmt: skip
    assert first.returncode == 0, first.stderr
    step3 = f"{url}/step-3"
    [row] = [r for r in Ledger(bucket_run / "lineage.sqlite").rows() if r.is_commit]
    assert row.checkpoint == step3

    # trainer.resume= a checkpoint URL (a new run, its checkpoints local): checked before any worker, loaded, continued.
    resumed = tmp_path / "resumed-run"
    second = _run("train", *COMMON, f"trainer.run_dir={resumed}", f"trainer.resume={step3}", *in_config)
    assert second.returncode == 0, second.stderr
    assert "resumed from step 3" in (resumed / "logs" / "rank0.log").read_text()
    commits = [r for r in Ledger(resumed / "lineage.sqlite").rows() if r.is_commit]
    assert [r.step for r in commits] == [6]
    assert commits[0].parent_manifest_sha256 == row.manifest_sha256, "the chain continues from the bucket checkpoint"
    # The same URL with the wrong secret: refused by the store before any worker starts.
    wrong = [f"+checkpoint.storage_options.{k}={'wrong' if k == 'secret' else v}" for k, v in options.items()]
    refused = _run("train", *COMMON, f"trainer.run_dir={tmp_path / 'refused'}", f"trainer.resume={step3}", *wrong)
    assert refused.returncode == 2, refused.stderr
    assert S3_BUCKET in refused.stderr
    assert not (tmp_path / "refused" / "logs").exists(), "no worker started"

    # The commands, with --storage-option only (in this process, its AWS environment removed).
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)

    def shardline(*args: str) -> tuple[int, str, str]:
        code = cli.main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = shardline("verify", step3, *flags)
    assert code == 0, err
    assert f"OK: {step3} (step 3)" in out
    code, _, err = shardline("verify", step3, "--storage-option", f"endpoint_url={s3_server.endpoint}")
    assert code != 0, "no credentials anywhere: the store refuses"
    code, out, err = shardline("inspect", step3, "--json", *flags)
    assert code == 0, err
    assert json.loads(out)["step"] == 3
    code, _, err = shardline("consolidate", step3, str(tmp_path / "weights.safetensors"), *flags)
    assert code == 0, err
    assert (tmp_path / "weights.safetensors").is_file()
    private, public = _write_key(tmp_path, "key", ec.generate_private_key(ec.SECP256R1()))
    code, _, err = shardline("sign", step3, "--private-key", str(private), *flags)
    assert code == 0, err
    code, out, err = shardline("verify", step3, "--public-key", str(public), *flags)
    assert code == 0, err
    assert f"OK: signature {step3}.sig verifies" in out

    # lineage and report of the run directory: the options its config.yaml recorded (its endpoint; the credentials
    # were redacted there), overlaid by the ones given.
    recorded = (bucket_run / "config.yaml").read_text()
    assert options["secret"] not in recorded, "the run recorded its credentials"
    assert s3_server.endpoint in recorded
    code, out, err = shardline("lineage", str(bucket_run))
    assert code == 2, "no credentials given and none recorded: the store refuses"
    assert S3_BUCKET in err
    creds = [f for f in flags if f.split("=", 2)[1] in ("key", "secret")]
    assert len(creds) == 2
    code, out, err = shardline("lineage", str(bucket_run), *creds)
    assert code == 0, err
    assert f"the bucket prefix {url}/ (endpoint {s3_server.endpoint}) is in the chain" in out
    code, out, err = shardline("lineage", str(bucket_run), "--json", *flags)
    assert code == 0, err
    assert json.loads(out)["rows"][0]["provenance"]["source"] == "checkpoint"
    wrong_flags = [f.replace(options["secret"], "wrong") for f in flags]
    code, out, err = shardline("lineage", str(bucket_run), *wrong_flags)
    assert code == 2, out + err
    code, out, err = shardline("report", str(bucket_run), *creds)
    assert code == 0, err
    assert "1 checkpoint(s), 1 verified" in out
    code, out, err = shardline("report", str(bucket_run), *wrong_flags)
    assert code == 2, out + err
