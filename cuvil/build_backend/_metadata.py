"""The `[project]` table (pyproject.toml specification, PEP 621/639) as core metadata.

`read_metadata` validates every field with `packaging` and returns a `CoreMetadata` that the
wheel and sdist writers render: METADATA / PKG-INFO, entry_points.txt and the license files.
Every error is a `ConfigError` that names pyproject.toml, the key and how to fix it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.headerregistry import Address
from pathlib import Path
from typing import Any

from packaging.markers import InvalidMarker, Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from cuvil.errors import ConfigError

__all__ = ["RUNTIME_REQUIREMENT", "CoreMetadata", "read_metadata"]

# The only runtime dependency of a generated package (it calls the library with numpy arrays).
RUNTIME_REQUIREMENT = "numpy>=1.22"

_KNOWN_KEYS = (
    "name",
    "version",
    "description",
    "readme",
    "requires-python",
    "license",
    "license-files",
    "authors",
    "maintainers",
    "keywords",
    "classifiers",
    "urls",
    "scripts",
    "gui-scripts",
    "entry-points",
    "dependencies",
    "optional-dependencies",
    "import-names",
    "import-namespaces",
    "dynamic",
)
_NAME_RE = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)
_README_TYPES = {".md": "text/markdown", ".rst": "text/x-rst", ".txt": "text/plain"}
_CONTENT_TYPES = ("text/markdown", "text/x-rst", "text/plain")
_LICENSE_GLOB_RE = re.compile(r"^[A-Za-z0-9_.\-*?/\[\]]+$")
# Files picked up when `license-files` is absent (the patterns PEP 639 suggests), at the root.
_DEFAULT_LICENSE_GLOBS = ("LICEN[CS]E*", "COPYING*", "NOTICE*", "AUTHORS*")
_ENTRY_GROUP_RE = re.compile(r"^\w+(\.\w+)*$")
_OBJECT_REF_RE = re.compile(r"^\w+(\.\w+)*(:\w+(\.\w+)*)?$")
_SCRIPT_NAME_RE = re.compile(r"^[\w.-]+$")
_IMPORT_NAME_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\s*;\s*private)?$")


@dataclass(frozen=True)
class CoreMetadata:
    """Validated core metadata of one project, ready to be written into archives."""

    name: str  # as written in pyproject.toml
    version: str  # normalized
    headers: tuple[tuple[str, str], ...]  # (field, value) in output order, without Metadata-Version
    metadata_version: str
    description: str | None = None
    entry_points: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # (path relative to the project root with "/", absolute path) of every License-File
    license_files: tuple[tuple[str, Path], ...] = ()
    # files the metadata was read from (readme, legacy license file), for the sdist
    source_files: tuple[Path, ...] = ()

    @property
    def distribution(self) -> str:
        """The name as archive file names spell it: normalized, with `_` for runs of `-_.`."""
        return canonicalize_name(self.name).replace("-", "_")

    @property
    def dist_info(self) -> str:
        return f"{self.distribution}-{self.version}.dist-info"

    def as_text(self) -> str:
        """The METADATA / PKG-INFO file: RFC 822 style headers, then the description as body."""
        lines = [f"Metadata-Version: {self.metadata_version}"]
        for key, value in self.headers:
            # Multi-line values (only License can have them) use 8-space continuation lines.
            lines.append(f"{key}: " + value.replace("\n", "\n" + " " * 8))
        text = "\n".join(lines) + "\n"
        if self.description is not None:
            text += "\n" + self.description
            if not self.description.endswith("\n"):
                text += "\n"
        return text

    def as_bytes(self) -> bytes:
        return self.as_text().encode("utf-8")

    def entry_points_text(self) -> str | None:
        """entry_points.txt, or None when the project declares none."""
        if not self.entry_points:
            return None
        parts = []
        for group in sorted(self.entry_points):
            entries = self.entry_points[group]
            lines = [f"[{group}]"] + [f"{name} = {entries[name]}" for name in sorted(entries)]
            parts.append("\n".join(lines) + "\n")
        return "\n".join(parts)


class _Reader:
    """Reads one `[project]` table; `fail` raises the error naming file and key."""

    def __init__(self, project: Mapping[str, Any], root: Path, pyproject: Path) -> None:
        self.project = project
        self.root = root
        self.pyproject = pyproject
        self.source_files: list[Path] = []

    def fail(self, key: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"{self.pyproject}: project.{key}: {problem}; {fix}")

    def get(self, key: str, kind: type | tuple[type, ...], expected: str) -> Any:
        value = self.project.get(key)
        if value is not None and not isinstance(value, kind):
            raise self.fail(
                key, f"expected {expected}, got {_describe(value)}", f"write {expected}"
            )
        return value

    def string_list(self, key: str) -> list[str]:
        value = self.get(key, list, "an array of strings")
        if value is None:
            return []
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise self.fail(
                    f"{key}[{index}]", f"expected a string, got {_describe(item)}", "quote it"
                )
        return list(value)

    def string_table(self, key: str, value: Any) -> dict[str, str]:
        if not isinstance(value, Mapping):
            raise self.fail(
                key,
                f"expected a table of strings, got {_describe(value)}",
                'write key = "value" pairs',
            )
        for name, item in value.items():
            if not isinstance(item, str):
                raise self.fail(
                    f"{key}.{name}", f"expected a string, got {_describe(item)}", "quote it"
                )
        return dict(value)

    def relative_file(self, key: str, value: str) -> Path:
        """An existing file named relative to the project root."""
        path = Path(value)
        if path.is_absolute():
            raise self.fail(
                key, f"{value!r} is an absolute path", "name the file relative to pyproject.toml"
            )
        full = self.root / path
        if not full.is_file():
            raise self.fail(
                key,
                f"file {value!r} does not exist in {self.root}",
                "create it or correct the path",
            )
        self.source_files.append(full)
        return full

    def read_text(self, key: str, path: Path, charset: str = "utf-8") -> str:
        try:
            return path.read_text(encoding=charset)
        except (UnicodeDecodeError, LookupError) as error:
            raise self.fail(
                key, f"cannot read {path.name} as {charset} ({error})", "save the file as UTF-8"
            ) from None


def read_metadata(
    project: Mapping[str, Any] | None,
    root: Path,
    pyproject: Path | None = None,
    version: str | None = None,
) -> CoreMetadata:
    """Validate the raw `[project]` table of the project at `root`; return its core metadata.

    `version` is the version `dynamic = ["version"]` stands for, as the config read it
    (`[tool.cuvil.metadata.version]`); without it, a dynamic version is refused.
    """
    pyproject = pyproject if pyproject is not None else root / "pyproject.toml"
    if project is None:
        raise ConfigError(
            f"{pyproject}: the [project] table is missing; add one with at least "
            'name = "..." and version = "..."'
        )
    reader = _Reader(project, root, pyproject)
    for key in project:
        if key not in _KNOWN_KEYS:
            raise reader.fail(
                key,
                "is not a key of the [project] table",
                "remove it or correct its spelling (cuvil's own options go under [tool.cuvil])",
            )
    _check_dynamic(reader, dynamic_version=version is not None)

    headers: list[tuple[str, str]] = []
    name = _name(reader)
    version = version if version is not None else _version(reader)
    headers += [("Name", name), ("Version", version)]
    metadata_version = "2.3"

    description = reader.get("description", str, "a one-line string")
    if description is not None:
        if "\n" in description or "\r" in description:
            raise reader.fail(
                "description",
                "contains a line break",
                "keep it to one line; long text goes in readme",
            )
        headers.append(("Summary", description))

    keywords = reader.string_list("keywords")
    for index, keyword in enumerate(keywords):
        if "," in keyword:
            raise reader.fail(
                f"keywords[{index}]",
                f"{keyword!r} contains a comma",
                "split it into separate keywords",
            )
    if keywords:
        headers.append(("Keywords", ",".join(keywords)))

    headers += _people(reader, "authors", "Author")
    headers += _people(reader, "maintainers", "Maintainer")

    classifiers = reader.string_list("classifiers")
    license_headers, license_files = _license(reader, classifiers)
    if any(key in ("License-Expression", "License-File") for key, _ in license_headers):
        metadata_version = "2.4"
    headers += license_headers
    headers += [("Classifier", classifier) for classifier in classifiers]

    requires_python = reader.get("requires-python", str, "a version specifier string")
    if requires_python is not None:
        try:
            headers.append(("Requires-Python", str(SpecifierSet(requires_python))))
        except InvalidSpecifier as error:
            raise reader.fail(
                "requires-python",
                f"{requires_python!r} is not a version specifier ({error})",
                'write e.g. ">=3.9"',
            ) from None

    urls = reader.get("urls", Mapping, "a table of label = URL")
    for label, url in reader.string_table("urls", urls or {}).items():
        if len(label) > 32 or "," in label or "\n" in label:
            raise reader.fail(
                f"urls.{label}",
                "the label is longer than 32 characters or contains a comma or line break",
                "use a short label such as Homepage, Documentation or Source",
            )
        if "\n" in url or not url.strip():
            raise reader.fail(f"urls.{label}", f"{url!r} is not a URL", "write one URL on one line")
        headers.append(("Project-URL", f"{label}, {url}"))

    headers += _dependencies(reader)

    import_headers = _import_names(reader)
    if import_headers:
        metadata_version = "2.5"
    headers += import_headers

    body, content_type = _readme(reader)
    if content_type is not None:
        headers.append(("Description-Content-Type", content_type))

    return CoreMetadata(
        name=name,
        version=version,
        headers=tuple(headers),
        metadata_version=metadata_version,
        description=body,
        entry_points=_entry_points(reader),
        license_files=tuple(license_files),
        source_files=tuple(dict.fromkeys(reader.source_files)),
    )


def _check_dynamic(reader: _Reader, dynamic_version: bool) -> None:
    dynamic = reader.string_list("dynamic")
    for index, key in enumerate(dynamic):
        where = f"dynamic[{index}]"
        if key not in _KNOWN_KEYS or key in ("name", "dynamic"):
            raise reader.fail(where, f"{key!r} cannot be dynamic", "remove it from project.dynamic")
        if key in reader.project:
            raise reader.fail(
                where,
                f"{key!r} is listed as dynamic but also set in [project]",
                f"remove {key!r} from project.dynamic",
            )
        if key == "version":
            if dynamic_version:
                continue
            raise reader.fail(
                where,
                "no version was read for it",
                'set project.version = "1.0.0", or read it with [tool.cuvil.metadata.version] '
                '(input = "src/<package>/__init__.py"; see docs/config.md)',
            )
        raise reader.fail(
            where,
            f"cuvil computes no metadata, so {key!r} cannot be dynamic",
            f"set project.{key} in pyproject.toml and remove it from project.dynamic",
        )


def _name(reader: _Reader) -> str:
    name = reader.get("name", str, "a string")
    if name is None:
        raise reader.fail("name", "is missing", 'add name = "my-model" to [project]')
    if not _NAME_RE.match(name):
        raise reader.fail(
            "name",
            f"{name!r} is not a valid project name",
            "use ASCII letters, digits, '.', '_' and '-', starting and ending with a letter "
            "or digit",
        )
    return name


def _version(reader: _Reader) -> str:
    version = reader.project.get("version")
    if version is None:
        raise reader.fail("version", "is missing", 'add version = "1.0.0" to [project]')
    if not isinstance(version, str):
        raise reader.fail(
            "version",
            f"expected a string, got {_describe(version)}",
            f'quote it: version = "{version}"',
        )
    try:
        return str(Version(version))
    except InvalidVersion:
        raise reader.fail(
            "version",
            f"{version!r} is not a valid version (PEP 440)",
            'write e.g. "1.0.0" or "2.1rc1"',
        ) from None


def _people(reader: _Reader, key: str, field_name: str) -> list[tuple[str, str]]:
    people = reader.get(key, list, "an array of tables")
    names: list[str] = []
    emails: list[str] = []
    for index, person in enumerate(people or []):
        where = f"{key}[{index}]"
        if not isinstance(person, Mapping):
            raise reader.fail(
                where,
                f"expected a table, got {_describe(person)}",
                '{ name = "...", email = "..." }',
            )
        unknown = sorted(set(person) - {"name", "email"})
        if unknown:
            raise reader.fail(
                f"{where}.{unknown[0]}", "is not a key of a person", "use only name and email"
            )
        name, email = person.get("name"), person.get("email")
        for part, value in (("name", name), ("email", email)):
            if value is not None and not isinstance(value, str):
                raise reader.fail(
                    f"{where}.{part}", f"expected a string, got {_describe(value)}", "quote it"
                )
        if not name and not email:
            raise reader.fail(where, "has neither name nor email", "give at least one of them")
        if name is not None and ("," in name or "\n" in name):
            raise reader.fail(
                f"{where}.name",
                f"{name!r} contains a comma or line break",
                "write the name without commas (the field joins several people with commas)",
            )
        if email is None:
            names.append(name or "")
            continue
        try:
            address = Address(display_name=name or "", addr_spec=email)
        except Exception as error:  # email raises several defect and value error types
            raise reader.fail(
                f"{where}.email",
                f"{email!r} is not an email address ({error})",
                "write user@example.org",
            ) from None
        if not address.domain:
            raise reader.fail(
                f"{where}.email", f"{email!r} has no domain", "write user@example.org"
            )
        emails.append(str(address))
    headers = []
    if names:
        headers.append((field_name, ", ".join(names)))
    if emails:
        headers.append((f"{field_name}-email", ", ".join(emails)))
    return headers


def _license(
    reader: _Reader, classifiers: list[str]
) -> tuple[list[tuple[str, str]], list[tuple[str, Path]]]:
    value = reader.project.get("license")
    headers: list[tuple[str, str]] = []
    if isinstance(value, str):
        expression = _license_expression(reader, value)
        headers.append(("License-Expression", expression))
        for index, classifier in enumerate(classifiers):
            if classifier.startswith("License ::"):
                raise reader.fail(
                    f"classifiers[{index}]",
                    f"{classifier!r} duplicates the SPDX expression in project.license",
                    "remove license classifiers when project.license is a string (PEP 639)",
                )
    elif isinstance(value, Mapping):
        if "license-files" in reader.project:
            raise reader.fail(
                "license",
                "is a table, but project.license-files is set",
                'write project.license as an SPDX expression string such as "MIT" (PEP 639)',
            )
        keys = sorted(value)
        if keys not in (["file"], ["text"]):
            raise reader.fail(
                "license",
                f"has keys {keys}",
                'write license = "MIT" (SPDX), or a table with exactly one of file or text',
            )
        if "file" in value:
            path_value = value["file"]
            if not isinstance(path_value, str):
                raise reader.fail(
                    "license.file", f"expected a string, got {_describe(path_value)}", "quote it"
                )
            text = reader.read_text(
                "license.file", reader.relative_file("license.file", path_value)
            )
        else:
            text = value["text"]
            if not isinstance(text, str):
                raise reader.fail(
                    "license.text", f"expected a string, got {_describe(text)}", "quote it"
                )
        headers.append(("License", text.strip("\n").replace("\r\n", "\n")))
    elif value is not None:
        raise reader.fail(
            "license",
            f"expected a string, got {_describe(value)}",
            'write an SPDX expression such as "MIT"',
        )

    files = _license_files(reader)
    headers += [("License-File", relative) for relative, _ in files]
    return headers, files


def _license_expression(reader: _Reader, value: str) -> str:
    try:
        from packaging.licenses import InvalidLicenseExpression, canonicalize_license_expression
    except ImportError:  # packaging < 24.2 cannot check expressions; keep what the user wrote
        if not value.strip():
            raise reader.fail(
                "license", "is empty", 'write an SPDX expression such as "MIT"'
            ) from None
        return value.strip()
    try:
        return str(canonicalize_license_expression(value))
    except InvalidLicenseExpression as error:
        raise reader.fail(
            "license",
            f"{value!r} is not a valid SPDX license expression ({error})",
            'write e.g. "MIT", "Apache-2.0 OR MIT" or "LicenseRef-Proprietary"',
        ) from None


def _license_files(reader: _Reader) -> list[tuple[str, Path]]:
    explicit = "license-files" in reader.project
    patterns = reader.string_list("license-files") if explicit else list(_DEFAULT_LICENSE_GLOBS)
    found: dict[str, Path] = {}
    for index, pattern in enumerate(patterns):
        where = f"license-files[{index}]"
        if explicit:
            _check_license_glob(reader, where, pattern)
        matches = sorted(path for path in reader.root.glob(pattern) if path.is_file())
        if explicit and not matches:
            raise reader.fail(
                where,
                f"{pattern!r} matches no file in {reader.root}",
                "correct the pattern or remove it (PEP 639 requires every pattern to match)",
            )
        for path in matches:
            relative = path.relative_to(reader.root).as_posix()
            reader.read_text(where, path)  # license files must be UTF-8 (PEP 639)
            found.setdefault(relative, path)
    return sorted(found.items())


def _check_license_glob(reader: _Reader, where: str, pattern: str) -> None:
    problem = None
    if not pattern or not _LICENSE_GLOB_RE.match(pattern):
        problem = "uses characters PEP 639 does not allow in license globs"
    elif pattern.startswith("/"):
        problem = "starts with '/'"
    elif ".." in pattern.split("/"):
        problem = "contains '..'"
    if problem:
        raise reader.fail(
            where,
            f"{pattern!r} {problem}",
            "write a glob relative to pyproject.toml using letters, digits, "
            '"._-/", "*", "?", "**" and [...]',
        )


def _dependencies(reader: _Reader) -> list[tuple[str, str]]:
    headers = []
    requirements = [
        _requirement(reader, f"dependencies[{index}]", text)
        for index, text in enumerate(reader.string_list("dependencies"))
    ]
    if not any(
        canonicalize_name(req.name) == "numpy" and req.marker is None for req in requirements
    ):
        requirements.append(Requirement(RUNTIME_REQUIREMENT))
    headers += [("Requires-Dist", str(req)) for req in requirements]

    optional = reader.get("optional-dependencies", Mapping, "a table of extra = [requirements]")
    seen: dict[str, str] = {}
    for extra, texts in (optional or {}).items():
        where = f"optional-dependencies.{extra}"
        if not _NAME_RE.match(extra):
            raise reader.fail(
                where,
                f"{extra!r} is not a valid extra name",
                "use letters, digits, '.', '_' and '-'",
            )
        normalized = canonicalize_name(extra)
        if normalized in seen:
            raise reader.fail(
                where,
                f"{extra!r} and {seen[normalized]!r} are the same extra once normalized",
                "merge them into one",
            )
        seen[normalized] = extra
        if not isinstance(texts, list):
            raise reader.fail(
                where, f"expected an array of strings, got {_describe(texts)}", '["pkg>=1"]'
            )
        headers.append(("Provides-Extra", normalized))
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise reader.fail(
                    f"{where}[{index}]", f"expected a string, got {_describe(text)}", "quote it"
                )
            req = _requirement(reader, f"{where}[{index}]", text)
            extra_marker = f'extra == "{normalized}"'
            req.marker = Marker(
                f"({req.marker}) and {extra_marker}" if req.marker else extra_marker
            )
            headers.append(("Requires-Dist", str(req)))
    return headers


def _requirement(reader: _Reader, where: str, text: str) -> Requirement:
    try:
        requirement = Requirement(text)
    except (InvalidRequirement, InvalidMarker) as error:
        raise reader.fail(
            where,
            f"{text!r} is not a valid requirement ({error})",
            'write a PEP 508 requirement such as "numpy>=1.22" or '
            "\"scipy; python_version >= '3.10'\"",
        ) from None
    return requirement


def _import_names(reader: _Reader) -> list[tuple[str, str]]:
    headers = []
    for key, field_name in (
        ("import-names", "Import-Name"),
        ("import-namespaces", "Import-Namespace"),
    ):
        for index, value in enumerate(reader.string_list(key)):
            if not _IMPORT_NAME_RE.match(value.strip()):
                raise reader.fail(
                    f"{key}[{index}]",
                    f"{value!r} is not an importable dotted name",
                    'write e.g. "digits" or "digits._private; private"',
                )
            headers.append((field_name, value.strip()))
    return headers


def _readme(reader: _Reader) -> tuple[str | None, str | None]:
    readme = reader.project.get("readme")
    if readme is None:
        return None, None
    if isinstance(readme, str):
        content_type = _README_TYPES.get(Path(readme).suffix.lower())
        if content_type is None:
            raise reader.fail(
                "readme",
                f"cannot tell the content type of {readme!r} from its extension",
                "name a .md, .rst or .txt file, or write "
                'readme = { file = "...", content-type = "text/markdown" }',
            )
        return reader.read_text("readme", reader.relative_file("readme", readme)), content_type
    if not isinstance(readme, Mapping):
        raise reader.fail(
            "readme",
            f"expected a string or table, got {_describe(readme)}",
            'write readme = "README.md"',
        )
    unknown = sorted(set(readme) - {"file", "text", "content-type"})
    if unknown:
        raise reader.fail(
            f"readme.{unknown[0]}", "is not a key of readme", "use file or text, and content-type"
        )
    content_type = readme.get("content-type")
    if not isinstance(content_type, str):
        raise reader.fail(
            "readme.content-type",
            "is missing or not a string",
            'add content-type = "text/markdown" (or "text/x-rst", "text/plain")',
        )
    mime, _, parameters = content_type.partition(";")
    if mime.strip().lower() not in _CONTENT_TYPES:
        raise reader.fail(
            "readme.content-type",
            f"{content_type!r} is not a content type PyPI renders",
            'use "text/markdown", "text/x-rst" or "text/plain"',
        )
    charset = "utf-8"
    match = re.search(r"charset\s*=\s*\"?([\w.-]+)", parameters, re.IGNORECASE)
    if match:
        charset = match.group(1)
    if ("file" in readme) == ("text" in readme):
        raise reader.fail(
            "readme",
            "needs exactly one of file or text",
            'write readme = { file = "README.md", content-type = "..." }',
        )
    if "file" in readme:
        if not isinstance(readme["file"], str):
            raise reader.fail(
                "readme.file", f"expected a string, got {_describe(readme['file'])}", "quote it"
            )
        path = reader.relative_file("readme.file", readme["file"])
        return reader.read_text("readme.file", path, charset), content_type
    if not isinstance(readme["text"], str):
        raise reader.fail(
            "readme.text", f"expected a string, got {_describe(readme['text'])}", "quote it"
        )
    return readme["text"], content_type


def _entry_points(reader: _Reader) -> dict[str, dict[str, str]]:
    groups: dict[str, dict[str, str]] = {}
    for key, group in (("scripts", "console_scripts"), ("gui-scripts", "gui_scripts")):
        value = reader.get(key, Mapping, 'a table of name = "module:function"')
        if value:
            groups[group] = _entry_group(reader, key, value, script=True)
    other = reader.get("entry-points", Mapping, "a table of entry point groups")
    for group, value in (other or {}).items():
        where = f"entry-points.{group}"
        if group in ("console_scripts", "gui_scripts"):
            key = "scripts" if group == "console_scripts" else "gui-scripts"
            raise reader.fail(where, "is not allowed here", f"declare these in project.{key}")
        if not _ENTRY_GROUP_RE.match(group):
            raise reader.fail(
                where,
                f"{group!r} is not a valid group name",
                "use a dotted name like my_app.plugins",
            )
        if not isinstance(value, Mapping):
            raise reader.fail(
                where, f"expected a table, got {_describe(value)}", 'write name = "module:object"'
            )
        groups[group] = _entry_group(reader, where, value, script=False)
    return groups


def _entry_group(
    reader: _Reader, key: str, value: Mapping[str, Any], script: bool
) -> dict[str, str]:
    entries = reader.string_table(key, value)
    for name, reference in entries.items():
        where = f"{key}.{name}"
        valid_name = (
            _SCRIPT_NAME_RE.match(name)
            if script
            else (
                name.strip() and "=" not in name and not name.startswith("[") and "\n" not in name
            )
        )
        if not valid_name:
            raise reader.fail(
                where,
                f"{name!r} is not a valid entry point name",
                "use letters, digits, '.', '_' and '-'",
            )
        normalized = re.sub(r"\s*:\s*", ":", reference.strip())
        if not _OBJECT_REF_RE.match(normalized):
            raise reader.fail(
                where,
                f"{reference!r} is not an object reference",
                'write "package.module:function"',
            )
        entries[name] = normalized
    return entries


def _describe(value: Any) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
    }
    if isinstance(value, Mapping):
        return "a table"
    return names.get(type(value), type(value).__name__)
