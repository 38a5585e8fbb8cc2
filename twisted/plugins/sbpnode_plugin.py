# The twistd drop-in: names the service maker and nothing else, so a broken node never breaks
# `twistd --help` for other plugins. The real work is in node/tap.py.
from twisted.application.service import ServiceMaker

sbpnode = ServiceMaker(
    "sbpnode",
    "node.tap",
    "A storage node serving SBP, key-value, Toasty, swarm and S2 protocols over one store",
    "sbpnode",
)
