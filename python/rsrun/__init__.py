"""rsrun, a torchrun replacement written in Rust, installed with pip.

The wheel carries two native programs, installed as console commands next to the Python
interpreter: ``rsrun`` (the launcher) and ``rsrun-rendezvous`` (the rendezvous service).
``python -m rsrun ARGS`` runs ``rsrun ARGS``, the way ``python -m torch.distributed.run`` runs
torchrun.
"""

import os
import shutil
import sys
import sysconfig

__all__ = ["find_bin"]


def find_bin(name: str = "rsrun") -> str:
    """Returns the path of the installed ``rsrun`` (or ``rsrun-rendezvous``) program.

    Raises ``FileNotFoundError`` naming the places looked at when it is not installed.
    """
    places = []
    # The scheme this interpreter installs scripts into (a venv's bin, the system's, the user's).
    places.append(sysconfig.get_path("scripts"))
    user_scheme = f"{os.name}_user"
    if user_scheme in sysconfig.get_scheme_names():
        places.append(sysconfig.get_path("scripts", scheme=user_scheme))
    # `pip install --prefix P` or `--target T`: <root>/lib/pythonX.Y/site-packages/rsrun, <T>/rsrun.
    here = os.path.dirname(os.path.abspath(__file__))
    places.append(os.path.join(here, "..", "..", "..", "..", "bin"))
    places.append(os.path.join(here, "..", "bin"))
    for place in places:
        candidate = os.path.normpath(os.path.join(place, name))
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"the {name} program is not installed (looked in {', '.join(places)} and PATH)")
