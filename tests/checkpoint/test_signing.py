"""``shardline sign``: OpenSSF model-signing signatures that the reference tool verifies without shardline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("model_signing", reason="the [signing] extra is not installed")
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from shardline import cli
from shardline.checkpoint import consolidate
from shardline.checkpoint.provenance.signing import sign, verify_signature
from shardline.errors import SignatureError

CLI = shutil.which("model_signing", path=str(Path(sys.executable).parent)) or shutil.which("model_signing")


def _write_key(directory: Path, name: str, key, password: bytes | None = None) -> tuple[Path, Path]:
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    private = directory / f"{name}.pem"
    public = directory / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("keys")
    return {
        "p256": _write_key(root, "p256", ec.generate_private_key(ec.SECP256R1())),
        "other": _write_key(root, "other", ec.generate_private_key(ec.SECP256R1())),
        "locked": _write_key(root, "locked", ec.generate_private_key(ec.SECP384R1()), b"s3cret"),
        "rsa": _write_key(root, "rsa", rsa.generate_private_key(public_exponent=65537, key_size=2048)),
    }


def _reference(signature: Path, public: Path, model: Path) -> subprocess.CompletedProcess:
    """Exactly the documented command of the reference tool, in a subprocess, no shardline involved."""
    assert CLI is not None, "the model_signing command is not installed"
    return subprocess.run(
        [CLI, "verify", "key", "--signature", str(signature), "--public_key", str(public), str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def signed(saved_run: Path, tmp_path: Path, keys) -> tuple[Path, Path]:
    ckpt = tmp_path / "step-4"
    shutil.copytree(saved_run / "step-4", ckpt)
    assert cli.main(["sign", str(ckpt), "--private-key", str(keys["p256"][0])]) == 0
    return ckpt, tmp_path / "step-4.sig"


def test_reference_tool_and_shardline_verify_the_signature(signed, keys, capsys) -> None:
    ckpt, sig = signed
    assert sig.is_file()
    done = _reference(sig, keys["p256"][1], ckpt)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Verification succeeded" in done.stdout
    capsys.readouterr()
    assert cli.main(["verify", str(ckpt), "--public-key", str(keys["p256"][1])]) == 0
    out = capsys.readouterr().out
    assert "OK: signature" in out
    assert "over 7 files" in out
    result = verify_signature(ckpt, public_key=keys["p256"][1])
    manifest_hash = (ckpt / "manifest.sha256").read_text().split()[0]
    assert result.manifest_sha256 == manifest_hash  # the signature pins the manifest hash
    assert set(result.files) == {p.name for p in ckpt.iterdir()}
    # another key: both refuse
    assert _reference(sig, keys["other"][1], ckpt).returncode != 0
    with pytest.raises(SignatureError, match="Key mismatch"):
        verify_signature(ckpt, public_key=keys["other"][1])


def test_a_flipped_byte_in_any_file_fails_both(signed, keys, tmp_path: Path) -> None:
    import model_signing

    ckpt, sig = signed
    names = sorted(p.name for p in ckpt.iterdir())
    assert {".metadata", "__0_0.distcp", "manifest.json", "provenance.intoto.json", "SHA256SUMS"} <= set(names)
    for i, name in enumerate(names):
        copy = tmp_path / f"flip{i}" / "step-4"
        shutil.copytree(ckpt, copy)
        _flip(copy / name)
        with pytest.raises(SignatureError, match=rf"{name}: altered"):
            verify_signature(copy, public_key=keys["p256"][1], signature=sig)
        # the reference library (what its CLI runs) refuses too
        with pytest.raises(ValueError, match="Signature mismatch"):
            model_signing.verifying.Config().use_elliptic_key_verifier(public_key=keys["p256"][1]).verify(copy, sig)
        if name in (".metadata", "__1_0.distcp"):  # and the command itself, for a data file and the pickle
            assert _reference(sig, keys["p256"][1], copy).returncode != 0
    extra = tmp_path / "extra" / "step-4"
    shutil.copytree(ckpt, extra)
    (extra / "notes.txt").write_text("added later")
    with pytest.raises(SignatureError, match=r"notes.txt: not signed"):
        verify_signature(extra, public_key=keys["p256"][1], signature=sig)


def test_exports_are_signed_too(saved_run: Path, tmp_path: Path, keys, capsys) -> None:
    out = tmp_path / "export"
    consolidate(saved_run / "step-4", out)
    assert cli.main(["sign", str(out), "--private-key", str(keys["p256"][0])]) == 0
    sig = tmp_path / "export.sig"
    assert _reference(sig, keys["p256"][1], out).returncode == 0
    capsys.readouterr()
    assert cli.main(["verify", str(out), "--public-key", str(keys["p256"][1])]) == 0
    text = capsys.readouterr().out
    assert "match the export record" in text
    assert "OK: signature" in text
    _flip(out / "model.safetensors")
    assert _reference(sig, keys["p256"][1], out).returncode != 0
    assert cli.main(["verify", str(out), "--public-key", str(keys["p256"][1])]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err
    assert "FAILED: signature" in err
    single = tmp_path / "model.safetensors"
    consolidate(saved_run / "step-4", single)
    result = sign(single, private_key=keys["p256"][0])
    assert _reference(Path(result.signature), keys["p256"][1], single).returncode == 0


def test_keys_and_places_that_are_refused(saved_run: Path, signed, keys, tmp_path: Path, monkeypatch) -> None:
    ckpt, _sig = signed
    with pytest.raises(SignatureError, match="already exists; pass --force"):
        sign(ckpt, private_key=keys["p256"][0])
    sign(ckpt, private_key=keys["p256"][0], overwrite=True)
    with pytest.raises(SignatureError, match="inside"):
        sign(ckpt, private_key=keys["p256"][0], signature=ckpt / "x.sig")
    with pytest.raises(SignatureError, match=r"RSAPrivateKey key.*P-256"):
        sign(ckpt, private_key=keys["rsa"][0], signature=tmp_path / "r.sig")
    with pytest.raises(SignatureError, match="encrypted: pass its password"):
        sign(ckpt, private_key=keys["locked"][0], signature=tmp_path / "l.sig")
    monkeypatch.setenv("KEY_PASSWORD", "s3cret")
    args = ["sign", str(ckpt), "--private-key", str(keys["locked"][0]), "--password-env", "KEY_PASSWORD"]
    assert cli.main([*args, "--signature", str(tmp_path / "l.sig")]) == 0
    assert verify_signature(ckpt, public_key=keys["locked"][1], signature=tmp_path / "l.sig").kind == "checkpoint"
    damaged = tmp_path / "damaged" / "step-4"
    shutil.copytree(saved_run / "step-4", damaged)
    _flip(damaged / "__0_0.distcp")
    with pytest.raises(SignatureError, match=r"refusing to sign.*__0_0.distcp: altered"):
        sign(damaged, private_key=keys["p256"][0])
    assert not (tmp_path / "damaged" / "step-4.sig").exists()
    with pytest.raises(SignatureError, match="no signature at"):
        verify_signature(damaged, public_key=keys["p256"][1])


def test_missing_extra_says_how_to_install(signed, keys, monkeypatch, capsys) -> None:
    ckpt, _ = signed
    monkeypatch.setitem(sys.modules, "model_signing", None)  # import fails as if not installed
    assert cli.main(["verify", str(ckpt), "--public-key", str(keys["p256"][1])]) == 1
    assert "pip install 'shardline[signing]'" in capsys.readouterr().err
    with pytest.raises(SignatureError, match=r"pip install 'shardline\[signing\]'"):
        sign(ckpt, private_key=keys["p256"][0], overwrite=True)
    assert os.environ.get("KEY_PASSWORD") is None
