"""``python -m gpumon.agent``: the agent alone, without the command line's parser (what
``gpumon agent`` becomes once its flags are parsed; see ``gpumon.agent.run``)."""

import os
import sys

if not __package__:  # run from its file: import the gpumon this file belongs to
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

from gpumon.agent.run import main  # noqa: E402 (after the path, on purpose)

main(sys.argv[1:])
