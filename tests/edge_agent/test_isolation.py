import subprocess
import sys


def test_the_edge_agent_imports_without_django():
    code = (
        "import sys, edge_agent, edge_agent.cli;"
        "bad = [m for m in sys.modules if m == 'django' or m.startswith(('django.', 'fleet', 'devices', 'training'))];"
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": "/usr/bin"})
    assert result.returncode == 0, result.stderr


def test_edge_agent_command_is_installed_and_reports_its_version():
    result = subprocess.run([sys.executable, "-m", "edge_agent", "--version"], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout.startswith("edge-agent ")
