"""``python -m training.node_agent``: the GPU node's agent (``training.node_agent.agent``)."""

import sys

from training.node_agent.agent import main

sys.exit(main())
