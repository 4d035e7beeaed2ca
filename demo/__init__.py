"""The demo: the setup ``make run`` seeds (a cohort, a factory-trained base, an adapter, a rollout) and the
simulated fleet of real agents it runs (``manage.py demo_fleet``); and ``sensor_model``, a team's own model as
the README's "Your own model" brings one (imported by its tests and ``bench/own_model.py`` too)."""
