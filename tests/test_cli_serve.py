"""`expresslane serve` from the command line: vLLM's flag names, HTTPS, and where it cannot
listen (exit 2 naming the flag, before the model loads)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from expresslane.__main__ import main


def _self_signed(folder) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    key, cert = str(folder / "key.pem"), str(folder / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    return key, cert


def test_serve_over_https(random_laneformer_dir, tmp_path, capsys):
    """vLLM's --ssl-keyfile / --ssl-certfile: the server answers HTTPS with the certificate; one
    flag alone, or a key that is not the certificate's, exits 2 before anything loads."""
    import socket
    import ssl

    import httpx

    key, cert = _self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=cert)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "expresslane", "serve",
                             str(random_laneformer_dir), "--port", str(port), "--ssl-keyfile", key,
                             "--ssl-certfile", cert], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        url, ok = f"https://127.0.0.1:{port}", False
        for _ in range(240):
            try:
                ok = httpx.get(url + "/health", verify=trust, timeout=5).status_code == 200
            except httpx.TransportError:
                pass
            if ok or proc.poll() is not None:
                break
            time.sleep(0.25)
        assert ok, proc.stderr.read() if proc.poll() is not None else "no answer"
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, verify=trust)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(30)
    (tmp_path / "other").mkdir()
    other_key, _ = _self_signed(tmp_path / "other")
    for argv, words in (
        (["--ssl-keyfile", key], "give both"),
        (["--ssl-keyfile", other_key, "--ssl-certfile", cert], "as a pair"),
    ):
        try:  # fmt: skip
            code = main(["serve", str(random_laneformer_dir), "--port", "0", *argv])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and words in err, err


def test_serve_takes_vllms_flag_names(random_laneformer_dir):
    from expresslane.__main__ import build_parser
    from expresslane.cli.serve import uvicorn_config

    base = ["serve", str(random_laneformer_dir)]
    plain = uvicorn_config(None, build_parser().parse_args(base))
    assert plain.access_log and plain.root_path == ""
    args = build_parser().parse_args([*base, "--disable-uvicorn-access-log", "--root-path", "/llm",
                                      "--enable-auto-tool-choice"])  # fmt: skip
    config = uvicorn_config(None, args)
    assert not config.access_log and config.root_path == "/llm"
    vllm = build_parser().parse_args([*base, "-tp", "2", "--no-enable-prefix-caching",
                                      "--enable-prefix-caching"])  # fmt: skip
    assert vllm.devices == 2 and vllm.no_prefix_reuse


def test_serve_where_it_cannot_listen_exits_2(random_laneformer_dir, capsys):
    """A port out of range, one in use, an unknown host: exit 2 naming the flag, before the
    model loads (uvicorn alone exits 3 with a traceback or a log line)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, word in ((["--port", "70000"], "--port"), (["--port", str(port)], f"{port}"),
                           (["--host", "no-such-host.invalid"], "--host")):  # fmt: skip
            try:
                code = main(["serve", str(random_laneformer_dir), *argv])
            except SystemExit as e:
                code = e.code
            err = capsys.readouterr().err
            assert code == 2 and word in err and "Traceback" not in err, err
