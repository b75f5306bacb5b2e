"""The project under an ASGI server, mtask's dashboard and REST API at /mtask/ for staff
(``uvicorn djproject.asgi:application``: tests/integration/test_django.py)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djproject.settings")
from mtask.contrib.django.asgi import with_dashboard

application = with_dashboard(get_asgi_application(), prefix="/mtask")
