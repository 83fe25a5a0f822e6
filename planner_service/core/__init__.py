"""Pure planning core: plan model, request validation, cost accounting, validator."""
