"""OpenAPI 3 documents load as registries: one tool per operation, named, described and given arguments as
``registry/openapi.py`` says; bad documents are refused naming the file and the place."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tooltrie.cli import main
from tooltrie.compiler import Artifact
from tooltrie.errors import RegistryError
from tooltrie.registry import OPENAPI_DIR, load_registry  # the documents bundled, installed as package data
from tooltrie.registry.model import Parameter
from tooltrie.registry.openapi import METHODS, plain_text

TMDB, SPOTIFY = OPENAPI_DIR / "tmdb.json", OPENAPI_DIR / "spotify.json"
DERANDOMIZE = not os.environ.get("TOOLTRIE_HYPOTHESIS_EXPLORE")

# (pointer, name) of some operations, from RestBench's own tool names for these documents (method and path).
RESTBENCH_NAMES = [
    (TMDB, "GET /person/{person_id}/movie_credits", "get_person_movie_credits"),
    (TMDB, "GET /tv/{tv_id}/season/{season_number}/episode/{episode_number}/credits",
     "get_tv_season_episode_credits"),
    (TMDB, "GET /search/movie", "get_search_movie"),
    (TMDB, "GET /genre/tv/list", "get_genre_tv_list"),
    (TMDB, "GET /trending/{media_type}/{time_window}", "get_trending"),
    (SPOTIFY, "GET /me/player/currently-playing", "get_me_player_currently_playing"),
    (SPOTIFY, "POST /playlists/{playlist_id}/tracks", "post_playlists_tracks"),
    (SPOTIFY, "PUT /me/player/play", "put_me_player_play"),
    (SPOTIFY, "DELETE /me/tracks", "delete_me_tracks"),
]


def _operations(path: Path) -> list[str]:
    """``"METHOD /path"`` of every operation of a document, read without the loader."""
    document = json.loads(path.read_text(encoding="utf-8"))
    return [f"{method.upper()} {route}" for route, item in document["paths"].items() for method in item
            if method in METHODS]


def _write(tmp_path: Path, document: object, suffix: str = ".json") -> Path:
    path = tmp_path / f"api{suffix}"
    text = yaml.safe_dump(document, sort_keys=False) if suffix == ".yaml" else json.dumps(document)
    path.write_text(text, encoding="utf-8")
    return path


def _document(paths: dict[str, Any], **components: Any) -> dict[str, Any]:
    document: dict[str, Any] = {"openapi": "3.0.3", "info": {"title": "demo", "version": "1"}, "paths": paths}
    if components:
        document["components"] = components
    return document


@pytest.mark.parametrize(("path", "operations", "methods"), [
    (TMDB, 54, {"GET": 54}),
    (SPOTIFY, 40, {"GET": 23, "PUT": 8, "POST": 5, "DELETE": 4}),
])
def test_the_bundled_documents_load_one_tool_per_operation(path: Path, operations: int,
                                                           methods: dict[str, int]) -> None:
    for names in ("operation_id", "path"):
        registry = load_registry(path, openapi_names=names, require_descriptions=True)
        assert [tool.pointer for tool in registry.tools] == _operations(path)
        assert len(registry) == operations
        counted: dict[str, int] = {}
        for tool in registry.tools:
            counted[tool.pointer.split(" ")[0]] = counted.get(tool.pointer.split(" ")[0], 0) + 1
        assert counted == methods


@pytest.mark.parametrize(("path", "pointer", "name"), RESTBENCH_NAMES)
def test_path_names_are_restbenchs(path: Path, pointer: str, name: str) -> None:
    registry = load_registry(path, openapi_names="path")
    assert registry.tools[registry.index(name)].pointer == pointer


def test_names_come_from_operation_ids_by_default() -> None:
    registry = load_registry(TMDB)
    tool = registry.tools[registry.index("GET_person-person_id-movie_credits")]
    assert tool.pointer == "GET /person/{person_id}/movie_credits"
    assert tool.description == ("Get Movie Credits. Get the movie credits for a person, the results contains various "
                                "information such as popularity and release date.")
    assert tool.parameters == (Parameter("person_id", type="integer", required=True),)  # from the path level
    assert load_registry(SPOTIFY).names[:3] == ["get-an-album", "get-an-albums-tracks", "get-an-artist"]


def test_the_bundled_documents_arguments() -> None:
    tmdb = load_registry(TMDB, openapi_names="path")
    trending = tmdb.tools[tmdb.index("get_trending")]
    assert [(p.name, p.type, p.required, p.values) for p in trending.parameters] == [
        ("media_type", "string", True, ("all", "movie", "tv", "person")),
        ("time_window", "string", True, ("day", "week"))]
    search = tmdb.tools[tmdb.index("get_search_movie")]
    assert [(p.name, p.required) for p in search.parameters][:3] == [("query", True), ("page", False),
                                                                     ("include_adult", False)]
    spotify = load_registry(SPOTIFY, openapi_names="path")
    add = spotify.tools[spotify.index("post_playlists_tracks")]
    assert add.tags == ("Playlists", "Tracks")
    assert add.description == "Add Items to Playlist. Add one or more items to a user's playlist."
    # playlist_id: a $ref to components.parameters, "required": "true" as a string; position and uris: query
    # parameters, kept over the request body's properties of the same names.
    assert [(p.name, p.type, p.required) for p in add.parameters] == [
        ("playlist_id", "string", True), ("position", "integer", False), ("uris", "string", False)]
    assert add.parameters[0].description == "The Spotify ID of the playlist."
    assert "<br/>" not in add.parameters[2].description and "_**Note**" not in add.parameters[2].description
    play = spotify.tools[spotify.index("put_me_player_play")]
    assert {"context_uri", "offset", "uris", "position_ms"} <= {p.name for p in play.parameters}  # the JSON body's


def test_yaml_and_json_documents_are_the_same_registry(tmp_path: Path) -> None:
    document = json.loads(SPOTIFY.read_text(encoding="utf-8"))
    from_yaml = load_registry(_write(tmp_path, document, ".yaml"), name="spotify")
    assert from_yaml.sha256 == load_registry(SPOTIFY).sha256


def test_the_compile_command_takes_an_openapi_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "pets.yaml"
    spec.write_text("""\
openapi: 3.1.0
info: {title: pets, version: "1"}
paths:
  /pets:
    get: {operationId: list_pets, summary: List the pets.}
    post: {summary: Add a pet.}
  /pets/{pet_id}:
    get: {operationId: show_pet, summary: One pet.}
""", encoding="utf-8")
    out = tmp_path / "pets.safetensors"
    assert main(["compile", str(spec), "-o", str(out)]) == 0
    assert f"{out}: 3 tools" in capsys.readouterr().err
    registry = Artifact.load(out).registry
    assert registry.names == ["list_pets", "post_pets", "show_pet"]  # post: no operationId, named by its path
    assert [tool.pointer for tool in registry.tools] == ["GET /pets", "POST /pets", "GET /pets/{pet_id}"]


def test_arguments_merge_path_and_operation_parameters_then_the_body(tmp_path: Path) -> None:
    document = _document({"/users/{user_id}": {
        "parameters": [{"name": "user_id", "in": "path", "description": "path level", "schema": {"type": "string"}},
                       {"name": "verbose", "in": "query", "schema": {"type": "boolean"}},
                       {"name": "session", "in": "cookie", "schema": {"type": "string"}}],
        "post": {
            "operationId": "update_user",
            "parameters": [{"name": "user_id", "in": "path", "required": True, "description": "The **user**.",
                            "schema": {"type": "integer"}},
                           {"$ref": "#/components/parameters/Trace"},
                           {"name": "Authorization", "in": "header", "schema": {"type": "string"}},
                           {"name": "filter", "in": "query", "content": {"application/json": {
                               "schema": {"type": "object"}}}}],
            "requestBody": {"$ref": "#/components/requestBodies/User"},
        }}},
        parameters={"Trace": {"name": "X-Trace", "in": "header", "required": "true", "schema": {"type": "string"}}},
        requestBodies={"User": {"content": {
            "text/plain": {"schema": {"type": "string"}},
            "application/json": {"schema": {"$ref": "#/components/schemas/User"}}}}},
        schemas={"User": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "description": "Full name."},
            "verbose": {"type": "string", "description": "a body property beside a query parameter"},
            "role": {"$ref": "#/components/schemas/Role", "description": "The role (3.1: beside a $ref)."},
            "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "manager": {"$ref": "#/components/schemas/User"}}},  # recursive: read one level deep
            "Role": {"type": "string", "enum": ["admin", "member"], "description": "Role's own text."}},
    )
    [tool] = load_registry(_write(tmp_path, document)).tools
    assert tool.parameters == (
        Parameter("user_id", "The user.", "integer", required=True),  # the operation's, in the path level's place
        Parameter("verbose", type="boolean"),  # the query parameter, not the body property
        Parameter("X-Trace", type="string", required=True),  # a $ref; the cookie and Authorization are left out
        Parameter("filter", type="object"),  # a schema given by content
        Parameter("name", "Full name.", "string", required=True),  # application/json before text/plain
        Parameter("role", "The role (3.1: beside a $ref).", "string", values=("admin", "member")),
        Parameter("nickname", type="string|null"),
        Parameter("manager", type="object"),
    )


def test_a_body_that_is_no_object_is_one_argument(tmp_path: Path) -> None:
    document = _document({"/upload": {"put": {"operationId": "upload", "requestBody": {
        "required": True, "description": "The file's <i>bytes</i>.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}}})
    [tool] = load_registry(_write(tmp_path, document)).tools
    assert tool.parameters == (Parameter("body", "The file's bytes.", "string", required=True),)


# (markdown or HTML, plain text)
PLAIN_TEXT_CASES = [
    ("## Heading\nText.", "Heading Text."),
    ("Title\n=====\nText", "Title Text"),
    ("See the [list](#endpoint:abc) and ![logo](x.png).", "See the list and logo."),
    ("A [reference][1] link.\n\n[1]: https://example.com", "A reference link."),
    ("<p>One<br/>two</p><a href=\"https://x\">three</a>", "One two three"),
    ("Tom &amp; Jerry &lt;3 &quot;q&quot;", 'Tom & Jerry <3 "q"'),
    ("**bold**, __bold__, *it*, _it_, ~~no~~, `code`", "bold, bold, it, it, no, code"),
    ("keep snake_case_names and 2*3*4", "keep snake_case_names and 2*3*4"),
    ("_**Note**: read it._", "Note: read it."),
    ("| a | b |\n|---|:-:|\n| 1 | 2 |", "a; b 1; 2"),
    ("- one\n* two\n1. three", "one two 1. three"),
    ("See <https://example.com/x>.", "See https://example.com/x."),
    ("```\ncode\n```", "code"),
    ("  many \n\n  spaces\t", "many spaces"),
]


@pytest.mark.parametrize(("marked", "plain"), PLAIN_TEXT_CASES)
def test_markdown_and_html_become_plain_text(marked: str, plain: str) -> None:
    assert plain_text(marked) == plain


OK_OPERATION = {"operationId": "ok", "responses": {"200": {"description": "fine"}}}
# (suffix, document, message pattern). "{file}" in a pattern stands for the escaped path of the file.
BAD_DOCUMENTS = [
    pytest.param(".json", {"swagger": "2.0", "paths": {"/a": {"get": OK_OPERATION}}},
                 r"{file}: top-level 'swagger': '2\.0': a Swagger 2\.0 document; OpenAPI 3 is needed", id="swagger-2"),
    pytest.param(".yaml", {"swagger": "2.0", "paths": {"/a": {"get": OK_OPERATION}}},
                 r"{file}: top-level 'swagger': '2\.0': a Swagger 2\.0 document; OpenAPI 3 is needed",
                 id="swagger-2-yaml"),
    pytest.param(".json", {"openapi": "2.0", "paths": {"/a": {"get": OK_OPERATION}}},
                 r"{file}: top-level 'openapi': '2\.0': OpenAPI 3\.x is needed", id="openapi-2"),
    pytest.param(".json", {"openapi": "3.0.0", "info": {}},
                 r"{file}: 'paths' must be a non-empty mapping of paths to operations, got nothing", id="no-paths"),
    pytest.param(".yaml", {"openapi": "3.0.0", "paths": {}},
                 r"{file}: 'paths' must be a non-empty mapping of paths to operations, got dict", id="empty-paths"),
    pytest.param(".json", _document({"/a": {"parameters": [], "summary": "no operation"}}),
                 r"{file}: 'paths' has no operations \(one of get, put, post", id="no-operations"),
    pytest.param(".json", _document({"/person/{id}": {"get": "list people"}, "/b": {"get": OK_OPERATION}}),
                 r"{file} \(paths\./person/\{{id\}}\.get\): expected a mapping \(an object\), got str 'list people'",
                 id="operation-not-a-mapping"),
    pytest.param(".json", _document({"/a": ["get"]}),
                 r"{file} \(paths\./a\): expected a mapping \(an object\), got list", id="path-item-not-a-mapping"),
    pytest.param(".json", _document({"/a": {"get": {"parameters": [
                     {"name": "q", "in": "query", "schema": {"$ref": "#/components/schemas/Nope"}}]}}},
                     schemas={"Query": {"type": "string"}}),
                 r"{file} \(paths\./a\.get\): \$ref '#/components/schemas/Nope' at paths\./a\.get\.parameters\[0\]"
                 r"\.schema points nowhere: no 'Nope' in #/components/schemas", id="ref-nowhere"),
    pytest.param(".json", _document({"/a": {"parameters": [{"$ref": "#/components/parameters/Q"}],
                                            "get": OK_OPERATION}}),
                 r"{file} \(paths\./a\.get\): \$ref '#/components/parameters/Q' at paths\./a\.parameters\[0\] "
                 r"points nowhere: no 'components' in #$", id="ref-nowhere-path-level"),
    pytest.param(".json", _document({"/a": {"get": {"requestBody": {"content": {"application/json": {
                     "schema": {"$ref": "#/components/schemas/A"}}}}}}},
                     schemas={"A": {"$ref": "#/components/schemas/B"}, "B": {"$ref": "#/components/schemas/A"}}),
                 r"{file} \(paths\./a\.get\): \$ref '#/components/schemas/A' at paths\./a\.get\.requestBody\.content"
                 r"\.application/json\.schema is a cycle: #/components/schemas/A -> #/components/schemas/B -> "
                 r"#/components/schemas/A", id="ref-cycle"),
    pytest.param(".json", _document({"/a": {"get": {"parameters": [{"$ref": "common.yaml#/parameters/Q"}]}}}),
                 r"{file} \(paths\./a\.get\): \$ref 'common\.yaml#/parameters/Q' at paths\./a\.get\.parameters\[0\] "
                 r"points outside the document", id="ref-external-file"),
    pytest.param(".json", _document({"/a": {"get": {"requestBody": {
                     "$ref": "https://example.com/api.json#/components/requestBodies/B"}}}}),
                 r"{file} \(paths\./a\.get\): \$ref 'https://example\.com/api\.json#/components/requestBodies/B' at "
                 r"paths\./a\.get\.requestBody points outside the document", id="ref-external-url"),
    pytest.param(".json", _document({"/a": {"get": {"parameters": [{"$ref": "#components"}]}}}),
                 r"{file} \(paths\./a\.get\): \$ref '#components' at paths\./a\.get\.parameters\[0\] is not a JSON "
                 r"pointer", id="ref-not-a-pointer"),
    pytest.param(".json", _document({"/a/{id}": {"get": {}}, "/b": {"get": OK_OPERATION}, "/a": {"get": {}}}),
                 r"{file}: GET /a/\{{id\}} \(paths\./a/\{{id\}}\.get\) and GET /a \(paths\./a\.get\) both give the "
                 r"tool name 'get_a'", id="path-names-collide"),
    pytest.param(".yaml", _document({"/a": {"get": {"operationId": "same"}, "post": {"operationId": "same"}}}),
                 r"{file}: GET /a \(paths\./a\.get\) and POST /a \(paths\./a\.post\) both give the tool name 'same'",
                 id="operation-ids-collide"),
    pytest.param(".json", _document({"/a": {"get": {"operationId": 7}}}),
                 r"{file} \(paths\./a\.get\): 'operationId' must be a string, got int 7", id="operation-id-not-text"),
    pytest.param(".json", _document({"/a": {"get": {"parameters": [{"name": "q", "in": "query", "required": "yes"}]}}}),
                 r"{file} \(paths\./a\.get\): paths\./a\.get\.parameters\[0\]\.required must be true or false, "
                 r"got str 'yes'", id="required-not-a-flag"),
    pytest.param(".json", _document({"/a": {"get": {"parameters": [{"name": "q", "in": "body"}]}}}),
                 r"{file} \(paths\./a\.get\): paths\./a\.get\.parameters\[0\] must be a mapping with a 'name' and "
                 r"'in'", id="parameter-in-body"),
    pytest.param(".json", _document({"/a": {"get": {"summary": ["not", "text"]}}}),
                 r"{file} \(paths\./a\.get\): paths\./a\.get\.summary must be a string, got list", id="summary-list"),
    pytest.param(".json", _document({"/a": {"get": {"tags": "pets"}}}),
                 r"{file} \(paths\./a\.get\) 'get_a': tags must be a list of strings", id="tags-not-a-list"),
]


@pytest.mark.parametrize(("suffix", "document", "pattern"), BAD_DOCUMENTS)
def test_bad_documents_are_refused_naming_the_file_and_the_place(tmp_path: Path, suffix: str, document: object,
                                                                 pattern: str) -> None:
    path = _write(tmp_path, document, suffix)
    with pytest.raises(RegistryError, match=pattern.format(file=re.escape(str(path)))):
        load_registry(path)


def test_one_bad_operation_is_reported_with_the_rest_loading(tmp_path: Path) -> None:
    from tooltrie.registry.problems import Problem

    path = _write(tmp_path, _document({"/a": {"get": "oops"}, "/b": {"get": {}, "put": {}}}))
    problems: list[Problem] = []
    assert load_registry(path, problems=problems).names == ["get_b", "put_b"]
    assert [problem.where for problem in problems] == [f"{path} (paths./a.get)"]


def test_an_unknown_naming_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"openapi_names must be one of \('operation_id', 'path'\), got 'camel'"):
        load_registry(TMDB, openapi_names="camel")  # type: ignore[arg-type]


# Literal segments may hold any of these; path parameters are named from other letters, so that a name that kept
# one would show it.
LITERAL = st.text(alphabet="abcdeXYZ019-_.~", min_size=1, max_size=6)
PARAMETER = st.text(alphabet="ghijk", min_size=1, max_size=4).map(lambda name: f"{{{name}}}")
SEGMENTS = st.lists(st.one_of(LITERAL, PARAMETER), min_size=0, max_size=4)
NEAR_MISSES = st.sampled_from(["a", "A", "a-b", "a_b", "a.b", "a--b", "b"])  # distinct paths, often one name
OPERATIONS = st.lists(st.tuples(st.sampled_from(METHODS[:3]), st.lists(st.one_of(LITERAL, NEAR_MISSES, PARAMETER),
                                                                         max_size=3).map(lambda p: "/" + "/".join(p))),
                      min_size=1, max_size=6, unique=True)


def _load(tmp_path: Path, operations: list[tuple[str, str]], file: str = "api.json") -> list[tuple[str, str]]:
    paths: dict[str, dict[str, object]] = {}
    for method, path in operations:
        paths.setdefault(path, {})[method] = {}
    (tmp_path / file).write_text(json.dumps(_document(paths)), encoding="utf-8")
    return [(tool.name, tool.pointer) for tool in load_registry(tmp_path / file, openapi_names="path").tools]


@settings(max_examples=60, deadline=None, derandomize=DERANDOMIZE, suppress_health_check=[HealthCheck.too_slow,
                                                                                           HealthCheck.function_scoped_fixture])
@given(operations=OPERATIONS)
def test_path_names_are_identifiers_and_collisions_are_refused(tmp_path: Path,
                                                               operations: list[tuple[str, str]]) -> None:
    alone = {operation: _load(tmp_path, [operation])[0] for operation in operations}  # each in a document of its own
    for (method, path), (name, pointer) in alone.items():
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", name) and name.isidentifier(), name
        assert not set(name.removeprefix(method)) & set("ghijk{}"), name  # path parameters are dropped
        assert pointer.split(" ", 1) == [method.upper(), path]
    document_order = sorted(operations, key=lambda operation: [p for _, p in operations].index(operation[1]))
    by_name: dict[str, list[tuple[str, str]]] = {}
    for operation in document_order:
        by_name.setdefault(alone[operation][0], []).append(operation)
    clashes = [same for same in by_name.values() if len(same) > 1]
    event("names collide" if clashes else "names distinct")
    if not clashes:
        assert _load(tmp_path, operations) == [alone[operation] for operation in document_order]
        return
    with pytest.raises(RegistryError, match="both give the tool name") as refused:
        _load(tmp_path, operations)
    named = re.findall(r"([A-Z]+) (/\S*) \(paths\.", str(refused.value))
    assert len(named) == 2 and alone[(named[0][0].lower(), named[0][1])][0] == alone[(named[1][0].lower(),
                                                                                     named[1][1])][0]


@settings(max_examples=40, deadline=None, derandomize=DERANDOMIZE, suppress_health_check=[HealthCheck.too_slow,
                                                                                           HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), segments=SEGMENTS, where=st.integers(0, 4), parameter=PARAMETER)
def test_two_paths_apart_by_a_parameter_are_refused_naming_both(tmp_path: Path, method: str, segments: list[str],
                                                                where: int, parameter: str) -> None:
    path = "/" + "/".join(segments)
    other = "/" + "/".join([*segments[:where], parameter, *segments[where:]])  # the same name, another path
    with pytest.raises(RegistryError) as refused:
        _load(tmp_path, [(method, path), (method, other)])
    upper = method.upper()
    assert f"{upper} {path} (paths.{path}.{method}) and {upper} {other} (paths.{other}.{method})" in str(refused.value)
