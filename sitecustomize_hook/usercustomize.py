"""quotawrap's usercustomize: loads the hook when another tool's sitecustomize shadowed ours.

See ``_quotawrap_hook``. Like the sitecustomize, it chains the user's own usercustomize first.
"""

from _quotawrap_hook import run

loaded = run("usercustomize", __file__)
