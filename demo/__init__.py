"""The demo: the setup ``make run`` seeds (a cohort, a factory-trained base, an adapter, a rollout) and the
simulated fleet of real agents it runs (``manage.py demo_fleet``). Nothing else imports it."""
