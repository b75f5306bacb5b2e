"""A Django project on django-mongodb-backend whose tasks run on mtask
(tests/integration/test_django.py). ``MTASK_DJANGO_URI``: the replica set; ``MTASK_DJANGO_DB``:
the project's database, mtask's too."""

import importlib.util
import os

SECRET_KEY = "only-for-the-tests"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
DATABASE = os.environ["MTASK_DJANGO_DB"]
INSTALLED_APPS = [
    "djproject.apps.MongoContentTypesConfig",
    "djproject.apps.MongoAuthConfig",
    "django.contrib.sessions",
    "mtask.contrib.django",
    "shop",
]
if importlib.util.find_spec("django.tasks") is None:  # Django 5.2: the backport
    INSTALLED_APPS.append("django_tasks")
MIGRATION_MODULES = {"auth": None, "contenttypes": None, "sessions": None, "shop": None}
"""No migrations: migrate makes the collections of every app as they are (syncdb)."""
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "djproject.urls"
DATABASES = {
    "default": {
        "ENGINE": "django_mongodb_backend",
        "HOST": os.environ["MTASK_DJANGO_URI"],
        "NAME": DATABASE,
    }
}
DEFAULT_AUTO_FIELD = "django_mongodb_backend.fields.ObjectIdAutoField"
# django-mongodb-backend 6.x asks for MongoDB 7.0 or later; this machine's (the embedded
# server's) is 6.0.5, which every feature used here has: the check is lowered to it
# (docs/integrations.md, "Django": MongoDB versions).
from django_mongodb_backend.features import DatabaseFeatures  # noqa: E402

DatabaseFeatures.minimum_database_version = (6, 0)
TASKS = {
    "default": {
        "BACKEND": "mtask.contrib.django.MtaskBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"database_alias": "default", "database": DATABASE},
    }
}
