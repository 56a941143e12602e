-- Argo CD health check for targetlease.dev/TargetLease (Lua 5.1, as Argo CD runs it).
-- Install: docs/gitops.md (argocd-cm key resource.customizations.health.targetlease.dev_TargetLease).
--
--   Healthy      Ready=True for the current generation (Held, or Released when asked to)
--   Progressing  no status yet, Pending, Waiting for another holder, a generation the controller
--                has not seen yet, a transient store failure being retried, or being deleted
--   Degraded     Failed (a person must act: corrupt record, access denied) or Lost
local hs = {}

-- Tokens are 16-digit integers: tostring would print them in %.14g, rounded.
local function integer(n)
  if type(n) == "number" then
    return string.format("%.0f", n)
  end
  return tostring(n)
end

local function condition(status, type_)
  if status == nil or status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == type_ then
      return c
    end
  end
  return nil
end

local status = obj.status
local generation = obj.metadata and obj.metadata.generation

if obj.metadata ~= nil and obj.metadata.deletionTimestamp ~= nil then
  hs.status = "Progressing"
  hs.message = "Being deleted: the controller releases the lease first"
  return hs
end

if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the controller to reconcile it"
  return hs
end

local ready = condition(status, "Ready")
local detail = ""
if ready ~= nil and ready.message ~= nil and ready.message ~= "" then
  detail = ": " .. ready.message
end

if generation ~= nil then
  local seen = status.observedGeneration
  if ready ~= nil and ready.observedGeneration ~= nil and (seen == nil or ready.observedGeneration < seen) then
    seen = ready.observedGeneration
  end
  if seen == nil or seen < generation then
    hs.status = "Progressing"
    hs.message = "The controller has not reconciled generation " .. integer(generation) .. " yet"
    return hs
  end
end

local phase = status.phase
if phase == "Failed" then
  hs.status = "Degraded"
  hs.message = "Failed" .. detail
  return hs
end
if phase == "Lost" then
  hs.status = "Degraded"
  hs.message = "Lost" .. detail
  return hs
end

if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  if phase == "Held" and status.permits ~= nil and status.permits > 1 then
    hs.message = "Held by " .. tostring(status.owner) .. " in slot " .. integer(status.slot) ..
      " of " .. integer(status.permits) .. " with fencing token " .. integer(status.fencingToken)
  elseif phase == "Held" then
    hs.message = "Held by " .. tostring(status.owner) .. " with fencing token " .. integer(status.fencingToken)
  else
    hs.message = phase .. detail
  end
  return hs
end

hs.status = "Progressing"
if phase == "Waiting" and status.heldBy ~= nil then
  hs.message = "Waiting: the target is held by " .. tostring(status.heldBy)
else
  hs.message = phase .. detail
end
return hs
