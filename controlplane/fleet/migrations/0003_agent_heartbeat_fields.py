from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0002_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="agent",
            name="device",
            field=models.CharField(blank=True, max_length=10),
        ),
        migrations.AddField(
            model_name="agent",
            name="gpu_memory_free_bytes",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="agent",
            name="running_jobs",
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AddField(
            model_name="agent",
            name="loaded_deployments",
            field=models.JSONField(blank=True, default=list),
        ),
    ]
