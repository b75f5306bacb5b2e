from django.db import models


class Order(models.Model):
    number = models.CharField(max_length=20)
    shipped = models.BooleanField(default=False)

    class Meta:
        app_label = "shop"


class Ran(models.Model):
    """One row per run of ``record``: the order the tasks ran in."""

    label = models.CharField(max_length=20)

    class Meta:
        app_label = "shop"
