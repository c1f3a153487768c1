"""Events are chained after their transaction commits (actions.chain_pending): each
gets `seq`, its position in the chain, and the head remembers the last one. Events
already written were chained in id order (0002), so seq follows id."""

from django.db import migrations, models


def backfill_seq(apps, schema_editor):
    AuditEvent = apps.get_model("audit", "AuditEvent")
    AuditChainHead = apps.get_model("audit", "AuditChainHead")
    seq = 0
    for pk in AuditEvent.objects.order_by("id").values_list("pk", flat=True):
        seq += 1
        AuditEvent.objects.filter(pk=pk).update(seq=seq)
    AuditChainHead.objects.filter(pk=1).update(last_seq=seq)


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0002_hash_chain"),
    ]

    operations = [
        migrations.AddField(
            model_name="auditevent",
            name="seq",
            field=models.BigIntegerField(blank=True, null=True, unique=True),
        ),
        migrations.AlterField(
            model_name="auditevent",
            name="prev_hash",
            field=models.CharField(blank=True, max_length=64),
        ),
        migrations.AlterField(
            model_name="auditevent",
            name="event_hash",
            field=models.CharField(blank=True, max_length=64),
        ),
        migrations.AddField(
            model_name="auditchainhead",
            name="last_seq",
            field=models.BigIntegerField(default=0),
        ),
        migrations.RunPython(backfill_seq, migrations.RunPython.noop),
    ]
