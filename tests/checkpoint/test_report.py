"""``shardline report``: one self-contained HTML page, its content checked here; rendered in headless Chromium
where one is installed."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.report import collect_run, write_report

pytest.importorskip("model_signing", reason="the [signing] extra is not installed")
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shardline.checkpoint.provenance.signing import sign

LOSSES = [5.5 - 0.5 * i for i in range(1, 7)]


class _Page(HTMLParser):
    """Tags, attributes and text of the page (to check it is self-contained)."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture
def run(saved_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A run directory: the shared 2-rank checkpoints, metrics, a summary, step-4 signed; returns (run, public key)."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run / "checkpoints")
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "val_loss", "attempt"])
        writer.writeheader()
        writer.writerow({"step": 0, "loss": "", "val_loss": "5.6", "attempt": 0})
        for step, loss in enumerate(LOSSES, start=1):
            writer.writerow({"step": step, "loss": repr(loss), "val_loss": "2.4" if step == 6 else "", "attempt": 0})
    summary = {"experiment": "parity", "strategy": "fsdp", "world_size": 2, "precision": "32-true",
               "model_parameters": 1234, "steps": 6, "tokens": 600, "wall_time_s": 3.2, "initial_val_loss": 5.6,
               "final_val_loss": 2.4, "corpus": "synthetic batches"}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pub = tmp_path / "pub.pem"
    pub.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    sign(run / "checkpoints" / "step-4", private_key=tmp_path / "key.pem")
    return run, pub


def test_page_is_self_contained_and_says_what_was_checked(run) -> None:
    run_dir, pub = run
    path, facts = write_report(run_dir, public_key=pub)
    html = path.read_text()
    page = _Page()
    page.feed(html)
    tags = [t for t, _ in page.tags]
    assert "script" not in tags
    assert "link" not in tags
    assert "iframe" not in tags
    for _, attrs in page.tags:  # nothing fetched from anywhere: no src/href but inline data and in-page anchors
        for name in ("src", "href"):
            value = attrs.get(name)
            assert value is None or value.startswith(("data:", "#")), (name, value)
    assert not re.search(r"url\((?!#)", html)  # CSS loads nothing either
    text = " ".join(page.text)
    # the run summary
    assert "parity" in text
    assert "5.6000 → 2.4000 (57% lower)" in text
    # the loss plot: one point per logged step, on an SVG polyline
    train = re.search(r'<polyline class="train" points="([^"]+)"', html).group(1).split()
    assert len(train) == len(LOSSES)
    ys = [float(p.split(",")[1]) for p in train]
    assert ys == sorted(ys)  # the loss falls, so each point is lower on the page (larger y)
    # the lineage picture: a box per checkpoint, an arrow from step-4 to its parent step-2
    assert html.count('class="node verified"') == 2
    assert html.count('class="edge"') == 1
    manifests = {c.name: c.row.manifest_sha256 for c in facts.checkpoints}
    for name, digest in manifests.items():
        assert digest in text
        assert f"cd {run_dir / 'checkpoints' / name}" in text
        assert f"sha256sum manifest.json      # must print {digest}" in text
    assert text.count("sha256sum -c SHA256SUMS      # every line must say OK") == 2
    # statuses, really checked: files re-hashed, signature verified with the key given
    assert [c.status for c in facts.checkpoints] == ["verified", "verified"]
    assert "signature verifies with pub.pem" in text
    sig = run_dir / "checkpoints" / "step-4.sig"
    assert f"model_signing verify key --signature {sig} --public_key {pub} {run_dir / 'checkpoints' / 'step-4'}" in text
    assert "Not signed. To sign it:" in text  # step-2 has no signature
    assert f"shardline sign {run_dir / 'checkpoints' / 'step-2'} --private-key KEY.pem" in text
    assert "Training configuration fingerprint" in text
    assert "git commit" in text


def test_the_printed_commands_work(run) -> None:
    """Run the page's own sha256sum and model_signing commands, as a reviewer would."""
    run_dir, pub = run
    path, _ = write_report(run_dir, public_key=pub)
    blocks = re.findall(r"<pre>(cd .*?)</pre>", path.read_text(), re.S)
    assert len(blocks) == 2
    for block in blocks:
        script = block.replace("&#x27;", "'").replace("&quot;", '"')
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        done = subprocess.run(
            ["bash", "-e", "-c", script], capture_output=True, text=True, timeout=120, check=False, env=env
        )
        assert done.returncode == 0, done.stderr
        expected = re.search(r"must print ([0-9a-f]{64})", script).group(1)
        assert done.stdout.splitlines()[0].split()[0] == expected
        assert "FAILED" not in done.stdout


def test_damage_and_deletion_show_up(run, capsys) -> None:
    run_dir, pub = run
    shard = run_dir / "checkpoints" / "step-2" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["report", str(run_dir), "--public-key", str(pub)]) == 1
    assert "NOT verified: step-2" in capsys.readouterr().out
    html = (run_dir / "report.html").read_text()
    assert 'class="node failed"' in html
    assert "__1_0.distcp: altered" in html
    facts = collect_run(run_dir)
    assert facts.checkpoints[1].signature_status.startswith("signed (signature file present; not checked")


def test_moved_and_deleted_checkpoints_are_told_apart(run) -> None:
    """A checkpoint's later tombstone row marks it deleted; a later quarantine row naming it marks it moved aside."""
    from shardline.checkpoint.provenance.ledger import Ledger
    from shardline.checkpoint.provenance.records import record_quarantine
    from shardline.checkpoint.provenance.retention import retire
    from shardline.checkpoint.storage.stores import locate
    from shardline.report.collect import Status

    run_dir, _ = run
    checkpoints = run_dir / "checkpoints"
    ledger = Ledger(checkpoints / "lineage.sqlite")
    retire(checkpoints / "step-2", ledger=ledger, reason="deleted to test the report")
    step4, aside = locate(checkpoints / "step-4"), locate(checkpoints / "step-4.damaged-test")
    record_quarantine(ledger, checkpoint=step4, moved_to=aside, recorded=ledger.recorded_hash(step4), reason="test")
    (checkpoints / "step-4").rename(checkpoints / "step-4.damaged-test")
    facts = collect_run(run_dir)
    status = {f.row.step: f.status for f in facts.checkpoints}
    assert status == {2: Status.DELETED, 4: Status.MOVED}
    moved = next(f for f in facts.checkpoints if f.row.step == 4)
    assert "moved aside to step-4.damaged-test: test" in moved.problems[0]


def test_no_ledger_is_said_plainly(tmp_path: Path) -> None:
    path, facts = write_report(tmp_path)
    assert facts.lineage_error
    assert "no lineage ledger found" in path.read_text()


def test_a_path_that_is_not_a_run_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    result = subprocess.run(
        [sys.executable, "-m", "shardline.cli", "report", str(missing)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert f"{missing} is not a run directory (no such directory)" in result.stderr
    assert not missing.exists(), "a report must not create the run directory it was pointed at"


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


# Per checkpoint card and lineage box of the rendered page: its id, the card badge's text and whether it is drawn.
_CHECKPOINTS_JS = """(() => {
  const shown = (el) => { const r = el.getBoundingClientRect(); const st = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && st.display !== 'none' && st.visibility !== 'hidden'; };
  const cards = [...document.querySelectorAll('section.card')].map((c) => {
    const badge = c.querySelector('h3 .badge');
    const verdict = c.querySelector('p.ok, p.bad, p.note');
    return {id: c.id, badge: badge ? badge.innerText : null, shown: badge ? shown(badge) : false,
            verdict: verdict ? verdict.innerText : null};
  });
  const boxes = [...document.querySelectorAll('svg.lineage text.status')].map((t) => t.textContent);
  return {cards, boxes, title: document.title};
})()"""


@pytest.mark.skipif(_browser() is None, reason="no headless Chromium installed (apt-get install chromium)")
def test_renders_in_headless_chromium(run, tmp_path: Path) -> None:
    """The page in a real browser: no console error, every checkpoint's verification result drawn, a screenshot
    (``report.png`` in this test's temporary directory) to look at. A page with an error shows the check sees one."""
    pytest.importorskip("aiohttp", reason="the DevTools client speaks over aiohttp's websocket (s3fs installs it)")
    from PIL import Image

    from tests.checkpoint.headless import open_pages

    run_dir, pub = run
    path, facts = write_report(run_dir, public_key=pub)
    broken = tmp_path / "broken.html"
    broken.write_text('<p>x</p><img src="no-such-image.png"><script>console.error("on purpose")</script>')
    page, control = open_pages(_browser(), [path.as_uri(), broken.as_uri()], script=_CHECKPOINTS_JS)
    shot = tmp_path / "report.png"
    shot.write_bytes(page.png)
    assert page.errors == [], page.errors
    assert any("on purpose" in e for e in control.errors), control.errors
    assert any("no-such-image.png" in e for e in control.errors), control.errors
    names = {c.name: c.status for c in facts.checkpoints}
    cards = {c["id"]: c for c in page.value["cards"]}
    assert set(cards) == set(names) == {"step-2", "step-4"}
    for name, status in names.items():
        assert cards[name]["badge"] == status.upper() == "VERIFIED", cards[name]
        assert cards[name]["shown"], f"the badge of {name} is not drawn"
        assert cards[name]["verdict"].startswith("Verified just now"), cards[name]
    assert page.value["boxes"] == ["VERIFIED", "VERIFIED"], "one lineage box per checkpoint, each with its result"
    image = Image.open(shot).convert("RGB")
    assert shot.stat().st_size > 10_000
    assert image.size == (1000, 2400)
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None
    assert len(colors) > 50
    pixels = {rgb for _, rgb in colors}
    assert (0x1E, 0x8E, 0x3E) in pixels  # the "verified" green of the badges and boxes
    assert (0x1A, 0x73, 0xE8) in pixels or any(abs(r - 0x1A) + abs(g - 0x73) + abs(b - 0xE8) < 40 for r, g, b in pixels)
