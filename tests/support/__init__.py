"""Helpers shared by the tests (tiny engines, server and child-process drivers), imported as
``tests.support.<module>``.  The ``*_child.py`` scripts run as files in child processes: each puts
the repository root on ``sys.path`` itself."""

import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))  # this folder: where the child scripts are
REPO = os.path.dirname(os.path.dirname(SUPPORT))  # the repository root
