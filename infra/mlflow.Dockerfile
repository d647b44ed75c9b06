# The MLflow tracking server of infra/base/mlflow.yaml: MLflow itself plus the PostgreSQL driver
# for the backend store and boto3 for an S3-compatible artifact store (the official MLflow image
# has neither).
#   docker build -f infra/mlflow.Dockerfile -t <registry>/osdp-mlflow:3.17.2 infra
# MLFLOW_VERSION must equal the one in infra/Dockerfile, so server and clients match.
ARG MLFLOW_VERSION=3.17.2
FROM python:3.11-slim

ARG MLFLOW_VERSION
RUN pip install --no-cache-dir "mlflow==${MLFLOW_VERSION}" "psycopg2-binary>=2.9" "boto3>=1.34" \
    && useradd --create-home --uid 1000 mlflow
USER mlflow
EXPOSE 5000
