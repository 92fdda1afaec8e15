"""tokenmill inside other systems' pipelines: Ray Data (``ray_data``) and Airflow
(``airflow``, which imports Airflow: import it only where Airflow is installed)."""
