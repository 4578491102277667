"""Who may use, list, load, unload and replace each served model: the tenancy of adapters.

- The base model, and the adapters loaded at start (`--lora-modules`) or by an admin key
  (`--admin-api-key`), are shared: every tenant uses and lists them. On a server whose keys carry
  tenants only an admin key unloads or replaces them.
- An adapter a tenant loads through `/v1/load_lora_adapter` is that tenant's: only its tenant
  (and admin keys) use, list and unload it, and its name is reserved while it is loaded. To every
  other tenant it answers exactly what an unknown name answers.
- A fine-tuning job's models (`ft:<base>:<suffix>:<job id>[:ckpt-step-N]`) and its checkpoint
  directories are the job's tenant's (`FinetuneService.may_use_model`, `may_load_path`): no other
  tenant uses, unloads or loads them, under their names or any other. Names starting with `ft:`
  are the service's: a tenant loads under such a name only its own job's models.

Without API keys, or when no key has a tenant, the server has one tenant: every caller may do
everything, as before tenancy. With API keys, `/v1/models` shows server paths (`root`) to admin
keys only; without keys (an open server) to everyone.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from flexserve.entrypoints.openai.auth import is_admin, owner_tenant
from flexserve.entrypoints.openai.errors import APIError, bad_request
from flexserve.finetune.adapters import parse_job_model_name
from flexserve.finetune.service import FinetuneService

JOB_MODEL_PREFIX = "ft:"
PRIVATE_ADAPTER = "private"  # the name a tenant's adapter is shown under where anyone can look
MAX_MODEL_NAME_CHARS = 256
# Control, format (bidirectional overrides such as U+202E), surrogate, private-use, unassigned
# and separator characters: none belongs in a name that is shown to people and used as a label.
_BAD_NAME_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"})


def check_name(value: str, param: str, what: str = "name") -> None:
    """400 for a model or suffix text that is empty, too long, or holds whitespace, control,
    format (bidirectional) or unassigned characters."""
    if not value or len(value) > MAX_MODEL_NAME_CHARS:
        raise bad_request(f"{param} must be 1-{MAX_MODEL_NAME_CHARS} characters long",
                          param=param, code="invalid_value")
    for char in value:
        if unicodedata.category(char) in _BAD_NAME_CATEGORIES:
            raise bad_request(f"{param} holds the character U+{ord(char):04X}, which a {what} "
                              "may not contain (whitespace, control, format or unassigned)",
                              param=param, code="invalid_value")


class ModelAccess:
    """The owners of the adapters loaded through the API, and the access rules above."""

    def __init__(self, service: FinetuneService | None, multi_tenant: bool,
                 keys_required: bool) -> None:
        self.service = service
        self.multi_tenant = multi_tenant  # some API key carries a tenant
        self.keys_required = keys_required  # API keys guard the server: paths for admins only
        self._owners: dict[str, str] = {}  # adapter name -> tenant that loaded it via the API

    def is_shared(self, name: str) -> bool:
        """Whether `name` is a shared adapter (neither a tenant's nor a job's)."""
        return name not in self._owners and not (
            self.service is not None
            and parse_job_model_name(self.service.base_model, name) is not None)

    def may_use(self, name: str, request: Any) -> bool:
        """Whether the caller may use (and see) the served name `name`."""
        if is_admin(request):
            return True
        tenant = owner_tenant(request)
        if self.service is not None and not self.service.may_use_model(name, tenant):
            return False
        owner = self._owners.get(name)
        return owner is None or owner == tenant

    def may_list(self, name: str, request: Any) -> bool:
        """Whether `/v1/models` lists the served adapter `name` to the caller."""
        return self.may_use(name, request) and (self.service is None
                                                or self.service.is_listed(name))

    def shows_paths(self, request: Any) -> bool:
        """Whether `/v1/models` may show the caller server paths."""
        return is_admin(request) or not self.keys_required

    def check_load(self, name: str, path: str, request: Any) -> None:
        """404 (as for an unknown name or path) when the caller may not load `path` as `name`;
        400 for a name of the `ft:` pattern that is no job's model."""
        if is_admin(request):
            return
        tenant = owner_tenant(request)
        if not self.may_use(name, request):
            raise adapter_not_found(name)
        if name.startswith(JOB_MODEL_PREFIX) and (
                self.service is None
                or parse_job_model_name(self.service.base_model, name) is None):
            raise bad_request(f"Adapter names starting with '{JOB_MODEL_PREFIX}' are reserved "
                              "for fine-tuned models.", param="lora_name", code="invalid_value")
        if self.service is not None and not self.service.may_load_path(path, tenant):
            raise APIError(404, f"Cannot load LoRA adapter '{name}': no adapter at lora_path.",
                           param="lora_path", code="not_found")

    def check_unload(self, name: str, request: Any, loaded: bool) -> None:
        """404 (as for an unknown name) when the caller may not unload `name`."""
        if is_admin(request):
            return
        if not self.may_use(name, request):
            raise adapter_not_found(name)
        if self.multi_tenant and loaded and self.is_shared(name):
            raise APIError(403, f"The lora adapter '{name}' is shared by every tenant: only an "
                                "admin key (--admin-api-key) may unload it.",
                           "permission_error", param="lora_name", code="permission_denied")

    def loaded(self, name: str, request: Any) -> None:
        """The caller loaded `name`: a tenant's own, unless an admin key (shared) or a job's."""
        if is_admin(request) or not self.multi_tenant:
            return
        if self.service is not None and parse_job_model_name(self.service.base_model,
                                                              name) is not None:
            return  # a job's model: its job's tenant owns it already
        self._owners[name] = owner_tenant(request)

    def unloaded(self, name: str) -> None:
        """`name` is no longer served: its name is free again."""
        self._owners.pop(name, None)


def adapter_not_found(name: str) -> APIError:
    return APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                    code="not_found")
