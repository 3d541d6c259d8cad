"""Object-store credentials in checkpoint.storage_options are used by the run and never recorded."""

from __future__ import annotations

from pathlib import Path

from shardline.train.config import to_yaml
from shardline.train.records import CONFIG_FILE, recorded_storage_options
from shardline.train.redaction import REDACTED, redact_options
from shardline.train.schema import TrainConfig

OPTIONS = {
    "endpoint_url": "http://127.0.0.1:8333",
    "key": "AKIA-EXAMPLE",
    "secret": "s3cr3t-value",
    "client_kwargs": {"region_name": "eu-west-1", "aws_session_token": "session-value"},
}
SECRETS = ("AKIA-EXAMPLE", "s3cr3t-value", "session-value")


def _config() -> TrainConfig:
    cfg = TrainConfig()
    cfg.checkpoint.dir = "s3://bucket/run"
    cfg.checkpoint.storage_options = {k: (dict(v) if isinstance(v, dict) else v) for k, v in OPTIONS.items()}
    return cfg


def test_the_recorded_config_names_no_credential_and_keeps_the_endpoint() -> None:
    cfg = _config()
    recorded = cfg.to_dict()["checkpoint"]["storage_options"]  # what each checkpoint's manifest records
    assert recorded == {
        "endpoint_url": "http://127.0.0.1:8333",
        "key": REDACTED,
        "secret": REDACTED,
        "client_kwargs": {"region_name": "eu-west-1", "aws_session_token": REDACTED},
    }
    text = to_yaml(cfg)  # config.yaml and the tracker's config text
    assert not [s for s in SECRETS if s in text], text
    assert "http://127.0.0.1:8333" in text
    assert cfg.checkpoint.storage_options["secret"] == "s3cr3t-value", "the run itself keeps using them"


def test_a_run_directory_is_reached_again_without_the_redacted_entries(tmp_path: Path) -> None:
    (tmp_path / CONFIG_FILE).write_text(to_yaml(_config()))
    assert recorded_storage_options(tmp_path) == {
        "endpoint_url": "http://127.0.0.1:8333",
        "client_kwargs": {"region_name": "eu-west-1"},
    }


def test_credential_names_of_each_store_are_recognised() -> None:
    names = ["token", "account_key", "sas_token", "connection_string", "client_secret", "password", "credential"]
    redacted = redact_options(dict.fromkeys(names, "x") | {"anon": False, "use_ssl": True, "region_name": "r"})
    assert {k for k, v in redacted.items() if v == REDACTED} == set(names)
    assert redacted["anon"] is False
    assert redacted["use_ssl"] is True
    assert redacted["region_name"] == "r"
