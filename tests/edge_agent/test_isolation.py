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


def test_the_training_loop_imports_without_django_or_transformers():
    code = (
        "import sys, edge_agent.training, edge_agent.packaging, edge_agent.power, edge_agent.samples,"
        " edge_agent.checkpoint, edge_agent.lora_layers, edge_agent.families.digits, edge_agent.families.minilm;"
        "from edge_agent.families import get_family; get_family('digits-cnn'); get_family('minilm-text');"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('django', 'fleet', 'devices', 'training',"
        " 'transformers', 'sklearn')];"
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": "/usr/bin"})
    assert result.returncode == 0, result.stderr
