"""A wheel install (not editable) still finds web/ and migrations/, which sit beside the package.

The wheel carries them as data files under {prefix}/share/megatrain. The test builds the wheel,
unpacks it into a fresh venv that borrows this environment's dependencies through a .pth line
(which does not run this environment's editable-install hook, so the checkout is not importable
there), and from outside the checkout migrates a database and serves the dashboard.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
import sys
from pathlib import Path
import megatrain
from megatrain import resource_dir
assert "site-packages" in megatrain.__file__, megatrain.__file__
web, migrations = resource_dir("web"), resource_dir("migrations")
assert web == Path(sys.prefix) / "share" / "megatrain" / "web", web
assert (migrations / "versions").is_dir(), migrations
from megatrain.db.session import upgrade_database
upgrade_database("sqlite:///" + sys.argv[1])
from fastapi.testclient import TestClient
from megatrain.api.app import create_app
page = TestClient(create_app()).get("/")
assert page.status_code == 200 and "js/app.js" in page.text, page.text[:200]
client = TestClient(create_app())
for asset in ("/vendor/swagger-ui/swagger-ui-bundle.js", "/vendor/redoc/redoc.standalone.js"):
    assert client.get(asset).status_code == 200, asset  # /docs and /redoc offline
print("ok", web)
"""


@pytest.mark.slow
def test_wheel_install_serves_the_dashboard_and_migrates(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("megatrain-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())  # fmt: skip
    (site / "borrowed-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # Unpacked as an installer does for a pure wheel (package and dist-info into site-packages, the
    # .data/data tree into the prefix). Not `pip install --prefix`: pip would first uninstall the
    # megatrain this environment has (the editable checkout the other tests run).
    data = f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.data/data/"
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            dest = venv / name.removeprefix(data) if name.startswith(data) else site / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(zf.read(name))
    assert (venv / "share" / "megatrain" / "web" / "index.html").is_file()
    home = tmp_path / "home"
    env = {"PATH": "/usr/bin:/bin", "MEGATRAIN_HOME": str(home), "HOME": str(home)}
    run = subprocess.run([py, "-c", CHECK, str(tmp_path / "db.sqlite")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "ok" in run.stdout
