"""The API's JSON writer (orjson) writes what ninja's own encoder would, including the values orjson would
write differently (datetimes) or not at all (integers beyond 64 bits)."""

import datetime
import decimal
import json
import uuid

from django.utils.translation import gettext_lazy
from ninja.renderers import JSONRenderer

from loom.api.renderer import FastJSONRenderer


def both(data):
    fast = FastJSONRenderer().render(None, data, response_status=200)
    plain = JSONRenderer().render(None, data, response_status=200)
    return json.loads(fast), json.loads(plain)


def test_datetimes_decimals_lazy_strings_and_int_keys_are_written_as_ninja_writes_them():
    data = {
        "when": datetime.datetime(2026, 11, 25, 7, 1, 2, 345678, tzinfo=datetime.UTC),
        "day": datetime.date(2026, 1, 2),
        "id": uuid.UUID(int=7),
        "share": decimal.Decimal("1.5"),
        "label": gettext_lazy("hello"),
        7: [(1, 2.5), None, True],
        "z": [[0.1 * i for i in range(50)] for _ in range(4)],
    }
    fast, plain = both(data)
    assert fast == plain
    assert fast["when"] == "2026-11-25T07:01:02.345Z"


def test_an_integer_beyond_64_bits_is_still_written():
    fast, plain = both({"seed": 10**30})
    assert fast == plain == {"seed": 10**30}


def test_the_api_answers_through_it(client, platform_user):
    client.force_login(platform_user[0])
    answer = client.get("/api/plan/catalog")
    assert answer.status_code == 200
    assert answer.content == FastJSONRenderer().render(None, answer.json(), response_status=200)
