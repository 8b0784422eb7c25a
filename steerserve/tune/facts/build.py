"""Build ``facts.jsonl`` offline from CLDR (``python -m steerserve.tune.facts.build``, ``--check``
compares); aliases never fold diacritics: es "París" must not accept the English "Paris".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from babel import Locale
from babel.core import get_global
from babel.numbers import get_territory_currencies

from steerserve.tune.facts import DATA, LANGS, RELATIONS

SPLIT_SHARES = (("train", 0.5), ("calib", 0.2), ("test", 0.3))

# (country, timezone whose CLDR exemplar city is the capital). Seats of government only where
# they are also the capital; Bern, Ankara, Washington, Beijing... have no timezone of their own.
CAPITALS: tuple[tuple[str, str], ...] = (
    ("FR", "Europe/Paris"), ("DE", "Europe/Berlin"), ("IT", "Europe/Rome"),
    ("ES", "Europe/Madrid"), ("PT", "Europe/Lisbon"), ("GB", "Europe/London"),
    ("IE", "Europe/Dublin"), ("NL", "Europe/Amsterdam"), ("BE", "Europe/Brussels"),
    ("AT", "Europe/Vienna"), ("DK", "Europe/Copenhagen"), ("NO", "Europe/Oslo"),
    ("SE", "Europe/Stockholm"), ("FI", "Europe/Helsinki"), ("IS", "Atlantic/Reykjavik"),
    ("PL", "Europe/Warsaw"), ("CZ", "Europe/Prague"), ("SK", "Europe/Bratislava"),
    ("HU", "Europe/Budapest"), ("RO", "Europe/Bucharest"), ("BG", "Europe/Sofia"),
    ("GR", "Europe/Athens"), ("RS", "Europe/Belgrade"), ("HR", "Europe/Zagreb"),
    ("SI", "Europe/Ljubljana"), ("BA", "Europe/Sarajevo"), ("MK", "Europe/Skopje"),
    ("AL", "Europe/Tirane"), ("ME", "Europe/Podgorica"), ("UA", "Europe/Kyiv"),
    ("BY", "Europe/Minsk"), ("LT", "Europe/Vilnius"), ("LV", "Europe/Riga"),
    ("EE", "Europe/Tallinn"), ("MD", "Europe/Chisinau"), ("RU", "Europe/Moscow"),
    ("CY", "Asia/Nicosia"), ("LI", "Europe/Vaduz"),
    ("JP", "Asia/Tokyo"), ("KR", "Asia/Seoul"), ("KP", "Asia/Pyongyang"),
    ("TW", "Asia/Taipei"), ("MN", "Asia/Ulaanbaatar"), ("TH", "Asia/Bangkok"),
    ("KH", "Asia/Phnom_Penh"), ("LA", "Asia/Vientiane"), ("MY", "Asia/Kuala_Lumpur"),
    ("ID", "Asia/Jakarta"), ("PH", "Asia/Manila"), ("BD", "Asia/Dhaka"),
    ("NP", "Asia/Kathmandu"), ("AF", "Asia/Kabul"), ("IR", "Asia/Tehran"),
    ("IQ", "Asia/Baghdad"), ("SY", "Asia/Damascus"), ("JO", "Asia/Amman"),
    ("LB", "Asia/Beirut"), ("SA", "Asia/Riyadh"), ("OM", "Asia/Muscat"),
    ("GE", "Asia/Tbilisi"), ("AM", "Asia/Yerevan"), ("AZ", "Asia/Baku"),
    ("UZ", "Asia/Tashkent"), ("TJ", "Asia/Dushanbe"), ("KG", "Asia/Bishkek"),
    ("TM", "Asia/Ashgabat"), ("BT", "Asia/Thimphu"), ("TL", "Asia/Dili"),
    ("EG", "Africa/Cairo"), ("DZ", "Africa/Algiers"), ("TN", "Africa/Tunis"),
    ("LY", "Africa/Tripoli"), ("SD", "Africa/Khartoum"), ("ET", "Africa/Addis_Ababa"),
    ("KE", "Africa/Nairobi"), ("UG", "Africa/Kampala"), ("RW", "Africa/Kigali"),
    ("GH", "Africa/Accra"), ("SN", "Africa/Dakar"), ("ML", "Africa/Bamako"),
    ("NE", "Africa/Niamey"), ("TD", "Africa/Ndjamena"), ("ZW", "Africa/Harare"),
    ("ZM", "Africa/Lusaka"), ("MZ", "Africa/Maputo"), ("AO", "Africa/Luanda"),
    ("GA", "Africa/Libreville"), ("SO", "Africa/Mogadishu"), ("MG", "Indian/Antananarivo"),
    ("BW", "Africa/Gaborone"), ("NA", "Africa/Windhoek"), ("LR", "Africa/Monrovia"),
    ("SL", "Africa/Freetown"), ("GN", "Africa/Conakry"), ("BF", "Africa/Ouagadougou"),
    ("MR", "Africa/Nouakchott"), ("ER", "Africa/Asmara"), ("SS", "Africa/Juba"),
    ("CF", "Africa/Bangui"), ("GM", "Africa/Banjul"), ("GW", "Africa/Bissau"),
    ("TG", "Africa/Lome"), ("BJ", "Africa/Porto-Novo"), ("LS", "Africa/Maseru"),
    ("AR", "America/Argentina/Buenos_Aires"), ("CL", "America/Santiago"),
    ("PE", "America/Lima"), ("CO", "America/Bogota"), ("VE", "America/Caracas"),
    ("UY", "America/Montevideo"), ("PY", "America/Asuncion"), ("MX", "America/Mexico_City"),
    ("CU", "America/Havana"), ("DO", "America/Santo_Domingo"), ("HT", "America/Port-au-Prince"),
    ("HN", "America/Tegucigalpa"), ("NI", "America/Managua"), ("SR", "America/Paramaribo"),
    ("BS", "America/Nassau"), ("TT", "America/Port_of_Spain"), ("PG", "Pacific/Port_Moresby"),
    ("WS", "Pacific/Apia"),
)  # fmt: skip

# Well-known non-capital cities that are timezone exemplar cities (unambiguous names only:
# no Córdoba, which is also in Spain).
CITIES: tuple[str, ...] = (
    "America/New_York", "America/Los_Angeles", "America/Chicago", "America/Denver",
    "America/Phoenix", "America/Detroit", "America/Anchorage", "Pacific/Honolulu",
    "America/Toronto", "America/Vancouver", "America/Edmonton", "America/Winnipeg",
    "America/Halifax", "America/Cancun", "America/Monterrey", "America/Tijuana",
    "America/Sao_Paulo", "America/Manaus", "America/Recife", "America/Fortaleza",
    "America/Belem", "America/Argentina/Mendoza", "America/Argentina/Ushuaia",
    "America/Guayaquil", "America/Punta_Arenas",
    "Australia/Sydney", "Australia/Melbourne", "Australia/Brisbane", "Australia/Perth",
    "Australia/Adelaide", "Australia/Darwin", "Australia/Hobart", "Pacific/Auckland",
    "Asia/Shanghai", "Asia/Urumqi", "Asia/Ho_Chi_Minh", "Asia/Kolkata", "Asia/Karachi",
    "Europe/Istanbul", "Asia/Vladivostok", "Asia/Novosibirsk", "Asia/Yekaterinburg",
    "Asia/Irkutsk", "Europe/Volgograd", "Europe/Kaliningrad", "Europe/Samara", "Asia/Omsk",
    "Asia/Krasnoyarsk", "Asia/Almaty", "Asia/Samarkand", "Europe/Zurich",
    "Africa/Johannesburg", "Africa/Lagos", "Africa/Casablanca", "Africa/Dar_es_Salaam",
    "Africa/Douala", "Africa/Abidjan", "Africa/Blantyre", "Asia/Dubai", "Asia/Kuching",
    "Asia/Makassar", "Asia/Yangon", "Asia/Colombo",
)  # fmt: skip

# Hand aliases where common usage differs from CLDR's form, keyed by (lang, code); code is a
# territory, timezone, language or currency code.
ALIASES: dict[tuple[str, str], tuple[str, ...]] = {
    ("en", "US"): ("USA", "US", "United States of America", "America"),
    ("en", "GB"): ("UK", "Britain", "Great Britain"),
    ("en", "CZ"): ("Czech Republic",),
    ("en", "TR"): ("Turkey",),
    ("en", "KR"): ("Korea",),
    ("en", "MK"): ("Macedonia",),
    ("en", "SZ"): ("Swaziland",),
    ("en", "CV"): ("Cabo Verde",),
    ("en", "TL"): ("East Timor",),
    ("en", "MM"): ("Burma",),
    ("en", "CI"): ("Ivory Coast",),
    ("en", "Europe/Kyiv"): ("Kiev",),
    ("en", "Asia/Kolkata"): ("Calcutta",),
    ("en", "Asia/Ho_Chi_Minh"): ("Ho Chi Minh", "Saigon"),
    ("en", "Asia/Yangon"): ("Rangoon",),
    ("en", "CNY"): ("Renminbi", "RMB"),
    ("en", "GBP"): ("Pound sterling", "Sterling"),
    ("zh", "zh"): ("汉语", "华语", "普通话"),
    ("zh", "CNY"): ("人民币", "元"),
    ("zh", "USD"): ("美金",),
    ("ja", "USD"): ("ドル",),
    ("ja", "CNY"): ("人民元", "元"),
    ("ja", "US"): ("アメリカ", "米国"),
    ("de", "US"): ("USA",),
    ("ru", "GBP"): ("британский фунт", "фунт стерлингов"),
    ("ko", "KR"): ("한국",),
    ("ko", "AU"): ("호주",),
    ("en", "bn"): ("Bengali",),
    ("en", "fa"): ("Farsi",),
    ("ja", "JPY"): ("円",),
    ("ja", "GBP"): ("ポンド",),
    ("ko", "JPY"): ("엔",),
    ("ko", "KRW"): ("원", "원화"),
    ("ru", "KR"): ("Южная Корея",),
    ("ru", "KP"): ("Северная Корея",),
    ("ru", "US"): ("США", "Соединённые Штаты"),
    ("de", "CNY"): ("Yuan", "Renminbi"),
    ("fr", "GBP"): ("livre",),
    ("es", "GBP"): ("libra",),
    ("pt", "GBP"): ("libra",),
    ("it", "GBP"): ("sterlina",),
    ("es", "Europe/Kyiv"): ("Kyiv",),
    ("fr", "Europe/Kyiv"): ("Kyiv",),
    ("ja", "Europe/Kyiv"): ("キエフ",),
    ("ko", "Europe/Kyiv"): ("키이우",),
}

# Languages with official status but whose name is a regional variety (CLDR lists Swiss German
# for CH); the standard language is listed too, so the variety adds only noise.
SKIP_LANGUAGES = {"gsw"}
# Cap facts sharing one answer (euro, Arabic, Spanish; cities in the US) so guessing the most
# common answer stays a weak strategy; the most prominent subjects are kept.
MAX_SAME_ANSWER = 5
MAX_CITIES_PER_COUNTRY = 4
# Countries in rough order of prominence: they win the slots under MAX_SAME_ANSWER; the others
# follow in CAPITALS, then CITIES order.
PROMINENT = (
    "US", "CN", "IN", "BR", "RU", "JP", "MX", "DE", "GB", "FR", "IT", "ES", "CA", "AU", "KR",
    "AR", "EG", "SA", "TR", "ID", "NG", "ZA", "PK", "IR",
)  # fmt: skip


@cache
def _locale(lang: str) -> Locale:
    return Locale.parse(lang)


def _dedupe(names: Iterable[str]) -> list[str]:
    """Order-preserving, case-insensitive unique non-empty names."""
    seen: set[str] = set()
    out: list[str] = []
    for n in names:
        n = " ".join(n.split())
        if n and n.casefold() not in seen:
            seen.add(n.casefold())
            out.append(n)
    return out


def _variants(name: str) -> list[str]:
    """A CLDR name and its mechanical variants: "Myanmar (Burma)" -> Myanmar, Burma; curly
    apostrophes -> straight; "&" -> "and"-free form is left to hand aliases."""
    out = [name]
    if "(" in name and name.endswith(")"):
        head, _, inner = name.partition("(")
        out += [head.strip(), inner[:-1].strip()]
    out += [n.replace("’", "'") for n in out if "’" in n]
    return out


def country_names(lang: str, cc: str) -> list[str]:
    """Localized country name first, then aliases."""
    name = _locale(lang).territories[cc]
    names = _variants(name)
    if lang == "en" and "&" in name:
        names.append(name.replace("&", "and"))
    names += ALIASES.get((lang, cc), ())
    primary = names[1] if len(names) > 1 and "(" in name else name  # "Myanmar", not "(Burma)"
    return _dedupe([primary, *names])


def _tz_city_fallback(tz: str) -> str:
    return tz.rsplit("/", 1)[-1].replace("_", " ")


def city_names(lang: str, tz: str) -> list[str]:
    """CLDR exemplar city of ``tz`` in ``lang`` (root inherits the timezone id's city)."""
    data = _locale(lang).time_zones.get(tz, {})
    name = data.get("city") if data else None
    if not name:
        if lang not in ("en", "fr", "es", "de", "it", "pt", "nl"):
            raise KeyError(f"no {lang} name for {tz}")
        name = _tz_city_fallback(tz)
    return _dedupe([*_variants(name), *ALIASES.get((lang, tz), ())])


def language_names(lang: str, code: str) -> list[str]:
    """Localized language name with its short forms (ar without the article, zh 语/文)."""
    name = _locale(lang).languages[code]
    names = _variants(name)
    if lang == "zh" and name.endswith("语"):
        names.append(name[:-1] + "文")
    if lang == "ar" and name.startswith("ال"):
        names.append(name[2:])
    names += ALIASES.get((lang, code), ())
    return _dedupe(names)


_ADJ_ENDINGS_RU = ("ий", "ый", "ой", "ая", "яя", "ое", "ее", "ские", "ский")


def _currency_head(lang: str, name: str, country: list[str]) -> list[str]:
    """The currency noun alone: "yen" for "Japanese Yen", "dollar" for "dollar des États-Unis"."""
    words = name.replace("-", " ").split()
    if lang in ("en", "de", "nl"):
        return [words[-1]] if len(words) > 1 else []
    if lang in ("fr", "es", "it", "pt", "ar"):
        return [words[0]] if len(words) > 1 else []
    if lang == "ru":
        nouns = [w for w in words if not w.endswith(_ADJ_ENDINGS_RU) and not w.isupper()]
        return nouns[:1] if len(words) > 1 else []
    if lang == "ko":
        return [words[-1]] if len(words) > 1 else []
    # zh / ja: strip the country's name when the currency name starts with it (瑞士法郎 -> 法郎)
    heads = [words[-1]] if len(words) > 1 else []
    for c in country:
        if name.startswith(c) and len(name) >= len(c) + 2:
            heads.append(name[len(c) :].strip())
    return heads


def currency_names(lang: str, code: str, cc: str) -> list[str]:
    """Localized currency name, plural forms, and the bare currency noun."""
    loc = _locale(lang)
    name = loc.currencies[code]
    plurals = loc._data["currency_names_plural"].get(code) or {}
    names = [name, *sorted(set(plurals.values()))]
    names += _currency_head(lang, name, country_names(lang, cc))
    names += ALIASES.get((lang, code), ())
    return _dedupe(names)


def _main_languages(cc: str) -> list[str]:
    """Official (or de facto official) languages spoken by >= 10 %, most spoken first."""
    info = get_global("territory_languages").get(cc, {})
    ranked = sorted(
        (
            (-v["population_percent"], code.split("_")[0])
            for code, v in info.items()
            if v.get("official_status") in ("official", "de_facto_official")
            and v["population_percent"] >= 10
        ),
    )
    return _dedupe(code for _, code in ranked if code not in SKIP_LANGUAGES)


def _currencies(cc: str) -> list[str]:
    return list(get_territory_currencies(cc, tender=True, non_tender=False))


def _records(relation: str, key: str, per_lang: dict[str, tuple[str, list[str]]]) -> list[dict]:
    fact_id = f"{relation}:{key}"
    answers_en = per_lang["en"][1]
    return [
        {
            "fact_id": fact_id,
            "relation": relation,
            "lang": lang,
            "subject": subject,
            "answers": answers,
            "answers_en": answers_en,
        }
        for lang, (subject, answers) in per_lang.items()
    ]


def _capped(facts: list[tuple[str, str]], cap: int = MAX_SAME_ANSWER) -> list[str]:
    """Keep at most ``cap`` facts per primary answer code (first come, first kept)."""
    count: Counter[str] = Counter()
    keep = []
    for key, answer in facts:
        count[answer] += 1
        if count[answer] <= cap:
            keep.append(key)
    return keep


def build_records() -> list[dict]:
    """All records, one per fact and language, with splits assigned."""
    zones = get_global("zone_territories")
    recs: list[dict] = []
    for cc, tz in CAPITALS:
        if zones.get(tz) != cc:
            raise ValueError(f"CLDR puts {tz} in {zones.get(tz)}, not {cc}")
        per = {lg: (country_names(lg, cc)[0], city_names(lg, tz)) for lg in LANGS}
        recs += _records("capital_of", cc, per)
    for tz in _capped([(tz, zones[tz]) for tz in CITIES], MAX_CITIES_PER_COUNTRY):
        cc = zones[tz]
        if tz in dict(CAPITALS).values():
            raise ValueError(f"{tz} is a capital; city_in lists other cities")
        per = {lg: (city_names(lg, tz)[0], country_names(lg, cc)) for lg in LANGS}
        recs += _records("city_in", f"{cc}-{_tz_city_fallback(tz).replace(' ', '_')}", per)
    seen = [*PROMINENT, *(cc for cc, _ in CAPITALS), *(zones[tz] for tz in CITIES)]
    countries = list(dict.fromkeys(seen))
    langs_of = {cc: _main_languages(cc) for cc in countries}
    for cc in _capped([(cc, langs_of[cc][0]) for cc in countries if langs_of[cc]]):
        per = {}
        for lg in LANGS:
            names = [n for code in langs_of[cc] for n in language_names(lg, code)]
            per[lg] = (country_names(lg, cc)[0], _dedupe(names))
        recs += _records("language_of", cc, per)
    curr = {cc: _currencies(cc) for cc in countries}
    for cc in _capped([(cc, curr[cc][0]) for cc in countries if curr[cc]]):
        per = {}
        for lg in LANGS:
            names = [n for code in curr[cc] for n in currency_names(lg, code, cc)]
            per[lg] = (country_names(lg, cc)[0], _dedupe(names))
        recs += _records("currency_of", cc, per)
    _assign_splits(recs)
    return recs


def _rank(fact_id: str) -> str:
    return hashlib.sha256(fact_id.encode()).hexdigest()


def _assign_splits(recs: list[dict]) -> None:
    """Split BY FACT, stratified per relation: facts ordered by a hash of their id get train /
    calib / test in 50/20/30 proportion, so a fact's translations always share a split."""
    by_rel: dict[str, list[str]] = defaultdict(list)
    for r in recs:
        if r["fact_id"] not in by_rel[r["relation"]]:
            by_rel[r["relation"]].append(r["fact_id"])
    split_of: dict[str, str] = {}
    for ids in by_rel.values():
        ids = sorted(ids, key=_rank)
        n, start = len(ids), 0
        for i, (name, share) in enumerate(SPLIT_SHARES):
            end = n if i == len(SPLIT_SHARES) - 1 else start + round(share * n)
            for fid in ids[start:end]:
                split_of[fid] = name
            start = end
    for r in recs:
        r["split"] = split_of[r["fact_id"]]


def render(recs: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=False) + "\n" for r in recs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DATA, help="where to write (default: packaged)")
    ap.add_argument("--check", action="store_true", help="exit 1 if --out is not up to date")
    args = ap.parse_args(argv)
    text = render(build_records())
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'OUT OF DATE'}")
        return 0 if same else 1
    args.out.write_text(text, encoding="utf-8")
    recs = [json.loads(line) for line in text.splitlines()]
    facts = {(r["fact_id"], r["relation"], r["split"]) for r in recs}
    per = Counter((rel, split) for _, rel, split in facts)
    print(f"wrote {len(recs)} records, {len(facts)} facts x {len(LANGS)} languages to {args.out}")
    for rel in RELATIONS:
        print(f"  {rel:12s} " + "  ".join(f"{s}={per[(rel, s)]}" for s, _ in SPLIT_SHARES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
