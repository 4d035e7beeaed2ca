from django.apps import AppConfig


class TrainingConfig(AppConfig):
    name = "training"

    def ready(self):
        # Imported here, not at the top: Django imports app configs before the models are ready, and these
        # modules use the models.
        from devices.socket_hooks import register_training_side
        from training.socket_entry import TrainingSocketEntry

        register_training_side(TrainingSocketEntry())
