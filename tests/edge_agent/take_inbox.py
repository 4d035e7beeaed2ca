"""``python -m tests.edge_agent.take_inbox HOME [--die-on NAME]``: one interval of ``edge-agent run``'s inbox
work in a process of its own (``edge_agent.cli.take_inbox``: the real inbox, reader and sample store), so a test
can start the agent again on the same home, or kill it mid-take. Prints the outcomes as JSON.

``--die-on NAME`` kills the process (SIGKILL, as the kernel's OOM killer does) when it reaches NAME, after the file
was claimed. The address space is capped, so a reader without bounds fails instead of taking the machine.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from pathlib import Path

import psutil

from edge_agent.api import Agent
from edge_agent.cli import inbox_for, take_inbox
from edge_agent.runtime import AgentConfig


def main(argv: list[str]) -> int:
    home = Path(argv[0])
    die_on = argv[argv.index("--die-on") + 1] if "--die-on" in argv else None
    agent = Agent(home)
    if die_on is not None:
        add_file = agent.add_file

        def add_or_die(path: Path) -> int:
            if path.name == die_on:
                os.kill(os.getpid(), signal.SIGKILL)
            return add_file(path)

        agent.add_file = add_or_die
    vms = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (vms + 3 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    print(json.dumps(take_inbox(inbox_for(home, AgentConfig.load(home)), agent)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
